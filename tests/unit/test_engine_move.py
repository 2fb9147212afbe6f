"""A decoding sequence moved out of one engine (`Engine.move_out`) and continued in
another from its KV (`add_imported_request(resume=...)`) produces the tokens and text
it would have produced without the move: greedy, seeded sampling, penalties, stop
strings and a grammar alike. The KV is copied tensor to tensor here (the transfer
backends have their own tests)."""

import pytest
from engine_steps import run

from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput

pytestmark = pytest.mark.unit

PROMPT = [{"role": "user", "content": "Write three sentences about the sea."}]


def tokens_and_text(outs):
    return [t for o in outs for t in o.new_token_ids], "".join(o.text for o in outs)


def move(src, dst, request_id):
    """Move `request_id` from `src` to `dst` as a draining decode replica would."""
    seq = src.move_out(request_id)
    assert seq is not None
    blocks = dst.reserve_import(seq.num_computed_tokens)
    assert blocks is not None and len(blocks) == len(seq.block_ids)
    dst.kv_cache.data[blocks] = src.kv_cache.data[seq.block_ids]
    src.release_blocks(seq.block_ids)
    return seq, blocks


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=5, frequency_penalty=1.5, presence_penalty=0.5,
                   ignore_eos=True),
    SamplingParams(max_tokens=60, temperature=0, stop=["sea.", "waves"], ignore_eos=True),
], ids=["greedy", "seeded", "penalties", "stop-strings"])
def test_a_moved_sequence_continues_as_if_it_had_stayed(make_engine, sampling):
    src, dst, ref = make_engine(), make_engine(), make_engine()
    prompt = ref.tokenizer.apply_chat_template(PROMPT)
    ref.add_request(prompt, sampling, request_id="r")
    want = tokens_and_text(run(ref, "r"))

    free0 = src.block_pool.num_free_blocks
    src.add_request(prompt, sampling, request_id="r")
    before = run(src, "r", n_steps=9)
    assert not before[-1].finished
    free = src.block_pool.num_free_blocks
    seq, blocks = move(src, dst, "r")
    assert src.block_pool.num_free_blocks > free  # its blocks came back once the copy was taken
    (ended,) = [o for o in src.step() if o.request_id == "r"]
    assert ended.finished and ended.finish_reason is FinishReason.MOVED and not ended.new_token_ids
    assert not src.has_unfinished() and src.block_pool.num_free_blocks == free0

    dst.add_imported_request("r", seq.token_ids[:-1], seq.token_ids[-1], sampling, blocks, resume=seq.resume)
    after = run(dst, "r")
    assert tokens_and_text(before + after) == want
    assert after[-1].num_output_tokens == len(want[0])


def test_a_structured_sequence_keeps_its_grammar_across_the_move(make_engine):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "pop": {"type": "integer"}},
              "required": ["city", "pop"], "additionalProperties": False}
    sampling = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput.json_schema(schema))
    src, dst, ref = make_engine(), make_engine(), make_engine()
    prompt = ref.tokenizer.apply_chat_template([{"role": "user", "content": "The largest city of France, as JSON."}])
    ref.add_request(prompt, sampling, request_id="r")
    want = tokens_and_text(run(ref, "r"))
    src.add_request(prompt, sampling, request_id="r")
    before = run(src, "r", n_steps=6)
    seq, blocks = move(src, dst, "r")
    dst.add_imported_request("r", seq.token_ids[:-1], seq.token_ids[-1], sampling, blocks, resume=seq.resume)
    assert tokens_and_text(before + run(dst, "r")) == want


def test_only_decoding_sequences_move(make_engine):
    eng = make_engine(max_num_batched_tokens=32)
    prompt = eng.tokenizer.apply_chat_template(PROMPT)
    eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0), request_id="r")
    assert eng.move_out("r") is None  # waiting
    eng.step()  # the first chunk of its prompt
    assert eng.move_out("r") is None  # prefilling
    assert eng.move_out("nobody") is None
    run(eng, "r")
