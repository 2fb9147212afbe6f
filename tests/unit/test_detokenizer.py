"""Incremental detokenization: stop strings cut exactly; UTF-8 never half-emitted."""

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def stream(tok, ids, stop=(), include=False):
    d = IncrementalDetokenizer(tok, [], list(stop), include)
    pieces = []
    for t in ids:
        text, hit = d.add([t])
        pieces.append(text)
        if hit:
            return pieces, True
    pieces.append(d.flush())
    return pieces, False


def test_utf8_split_across_tokens_streams_whole_characters(base_engine):
    tok = base_engine.tokenizer
    text = "Café 🙂 naïve 東京"
    ids = tok.encode(text)
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The emoji and the CJK characters span several byte-level tokens each.
    assert len(ids) > len(text.split())


def test_stop_string_cuts_text_exactly(base_engine):
    tok = base_engine.tokenizer
    ids = tok.encode("The answer is forty-two. Then more text follows here.")
    pieces, hit = stream(tok, ids, stop=["two."])
    assert hit and "".join(pieces) == "The answer is forty-"
    pieces, hit = stream(tok, ids, stop=["two."], include=True)
    assert "".join(pieces) == "The answer is forty-two."
    # A stop string that never appears: everything is emitted, nothing held back.
    pieces, hit = stream(tok, ids, stop=["zebra"])
    assert not hit and "".join(pieces) == "The answer is forty-two. Then more text follows here."


def test_engine_stop_string_and_seeded_repeat(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert "Paris" in full.text
    cut = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0, stop=["Paris"]))[0]
    assert cut.text == full.text[: full.text.index("Paris")]
    assert cut.finish_reason == "stop"
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123)
    a, b = engine.generate([prompt, prompt], [sp, SamplingParams(**{**sp.__dict__})])
    assert a.token_ids == b.token_ids


def test_a_resumed_detokenizer_continues_the_text_exactly(base_engine):
    """Its state moved to another engine after any token (mid-character, mid-stop-
    string), the text the client gets is the same as without the move."""
    tok = base_engine.tokenizer
    ids = tok.encode("Café 🙂 naïve: the end. 東京")
    stop = ["end.", "zz"]
    whole, hit = stream(tok, ids, stop)
    assert hit and "".join(whole) == "Café 🙂 naïve: the "
    stops_at = len(whole)  # the token that completes the stop string, counted from 1
    for cut in range(1, stops_at):
        first = IncrementalDetokenizer(tok, [], stop)
        pieces = [first.add([t])[0] for t in ids[:cut]]
        resumed = IncrementalDetokenizer.resume(tok, first.state(), stop)
        for t in ids[cut:]:
            text, hit_after = resumed.add([t])
            pieces.append(text)
            if hit_after:
                break
        assert hit_after and "".join(pieces) == "".join(whole), cut
