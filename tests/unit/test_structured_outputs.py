"""Structured outputs in the engine (engine/structured.py): every token is checked
against the request's grammar, the output is a complete document, other rows of the
batch are untouched, and an engine that takes a request over (decode after a
handoff) resumes the grammar from the request's tokens."""

from __future__ import annotations

import json
import re

import pytest

from engine.errors import InvalidRequest
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput

pytestmark = pytest.mark.unit

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture
def chat(engine):
    def prompt(text: str) -> list[int]:
        return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    return prompt


def greedy(structured: StructuredOutput | None, max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured=structured, **kw)


def test_json_schema_output_is_a_document_of_that_schema(engine, chat):
    out = engine.generate([chat("Describe a person as JSON.")], greedy(StructuredOutput.json_schema(PERSON)))[0]
    doc = json.loads(out.text)
    assert list(doc) == ["name", "age", "city"]  # the schema's order
    assert isinstance(doc["name"], str) and 0 <= doc["age"] <= 120 and doc["city"] in ("Paris", "Rome", "Oslo")
    assert out.finish_reason is FinishReason.STOP


def test_json_object_regex_and_choice(engine, chat):
    p = chat("Answer with JSON.")
    sampled = SamplingParams(max_tokens=160, temperature=0.7, seed=2, structured=StructuredOutput("json_object"))
    out = engine.generate([p], sampled)[0]
    assert out.finish_reason is FinishReason.STOP and isinstance(json.loads(out.text), dict)
    phone = engine.generate([chat("A phone number?")], greedy(StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}")))[0]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text) and phone.finish_reason is FinishReason.STOP
    choice = engine.generate([chat("Is Paris in France?")], greedy(StructuredOutput.choice(["yes", "no", "maybe"])))
    assert choice[0].text in ("yes", "no", "maybe")


def test_a_document_cut_by_max_tokens_ends_with_length(engine, chat):
    out = engine.generate([chat("Describe a person as JSON.")], greedy(StructuredOutput.json_schema(PERSON), 5))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5 and out.text.startswith("{")


def test_other_rows_of_the_batch_are_untouched(engine, chat):
    free = chat("Tell me about Paris.")
    alone = engine.generate([free], greedy(None, 24, ignore_eos=True))[0].token_ids
    both = engine.generate([free, chat("Describe a person as JSON.")],
                           [greedy(None, 24, ignore_eos=True), greedy(StructuredOutput.json_schema(PERSON))])
    assert both[0].token_ids == alone
    json.loads(both[1].text)


def test_a_grammar_dead_end_ends_that_request_cleanly_and_the_batch_goes_on(engine, chat):
    """A matcher that fails mid-document (llguidance hit one of its limits; forced here
    by feeding the real matcher a token it refuses) allows nothing more: the request
    ends with `grammar_dead_end`, keeping the valid prefix it had, its blocks freed,
    and the free row beside it is unchanged."""
    free = chat("Tell me about Paris.")
    alone = engine.generate([free], greedy(None, 12, ignore_eos=True))[0].token_ids
    baseline = engine.stats().kv_blocks_free
    doc = engine.add_request(chat("Describe a person as JSON."), greedy(StructuredOutput.json_schema(PERSON)))
    other = engine.add_request(free, greedy(None, 12, ignore_eos=True))
    outs: dict[str, list] = {doc: [], other: []}
    for _ in range(3):  # two tokens of the document, then its matcher fails
        for o in engine.step():
            outs[o.request_id].append(o)
    matcher = engine.scheduler.requests[doc].grammar
    assert not matcher.advance(engine.tokenizer.encode("zz"))  # the real matcher, now in its error state
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    end = outs[doc][-1]
    assert end.finished and end.finish_reason is FinishReason.GRAMMAR_DEAD_END and not end.new_token_ids
    assert "".join(o.text for o in outs[doc]).startswith("{")
    assert [t for o in outs[other] for t in o.new_token_ids] == alone
    assert engine.stats().kv_blocks_free == baseline


def test_decode_resumes_the_grammar_after_the_first_token(make_engine, chat):
    """prefill samples the first token under the grammar; decode adopts the request
    (here recomputing the prompt) and continues the same document."""
    p = chat("Describe a person as JSON.")
    sp = greedy(StructuredOutput.json_schema(PERSON))
    want = make_engine().generate([p], sp)[0].token_ids
    prefill, decode = make_engine(role="prefill"), make_engine(role="decode")
    first = prefill.generate([p], sp)[0].token_ids
    assert first == want[:1]
    decode.add_imported_request("r", p, first[0], sp, None)
    got = list(first)
    while decode.has_unfinished():
        got += [t for o in decode.step() for t in o.new_token_ids]
    assert got == want


def test_a_prefix_resumes_a_migrated_document(engine, chat):
    p = chat("Describe a person as JSON.")
    full = engine.generate([p], greedy(StructuredOutput.json_schema(PERSON)))[0].token_ids
    resumed = StructuredOutput("json_schema", json.dumps(PERSON), prefix=tuple(full[:6]))
    rest = engine.generate([p + full[:6]], greedy(resumed, 48 - 6))[0].token_ids
    assert full[:6] + rest == full


@pytest.mark.parametrize("structured, param", [
    (StructuredOutput("json_schema", '{"type": "objekt"}'), "response_format"),
    (StructuredOutput("regex", "[a-", "guided_regex"), "guided_regex"),
])
def test_an_invalid_grammar_is_refused_naming_its_field(engine, structured, param):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("hi", greedy(structured))
    assert e.value.field == param
    assert not engine.has_unfinished()
    with pytest.raises(InvalidRequest):
        StructuredOutput.choice([""])


async def test_the_matcher_is_compiled_off_the_engine_thread(make_engine, chat):
    """A large schema must not stall every other request's step: AsyncEngine builds the
    matcher on a worker thread and hands it to the engine with the request."""
    import threading

    from engine.async_engine import AsyncEngine

    engine = make_engine()
    built_on: list[str] = []
    compile_matcher = engine.grammars.matcher

    def spy(spec, output_ids):
        built_on.append(threading.current_thread().name)
        return compile_matcher(spec, output_ids)

    engine.grammars.matcher = spy  # type: ignore[method-assign]
    ae = AsyncEngine(engine)
    try:
        stream = await ae.add_request("r", chat("Describe a person as JSON."),
                                      greedy(StructuredOutput.json_schema(PERSON)))
        text = "".join([o.text async for outs in stream for o in outs])
    finally:
        ae.shutdown()
    json.loads(text)
    assert len(built_on) == 1 and built_on[0] != "duet-engine", built_on  # the engine thread's name


def test_the_bitmask_is_applied_bit_for_bit_and_filled_in_parallel_as_row_by_row(engine, chat):
    import torch

    from engine.structured import GrammarMatcher, apply_bitmask

    vocab = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(3, vocab)
    want = logits.clone()
    for r in range(3):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, want)

    spec = StructuredOutput.json_schema(PERSON)
    prefix = engine.tokenizer.encode('{"name": "Al')
    matchers = [engine.grammars.matcher(spec, prefix[:k]) for k in (0, 2, len(prefix))]
    words = (engine.model_config.vocab_size + 31) // 32
    parallel, one_by_one = torch.zeros(3, words, dtype=torch.int32), torch.zeros(3, words, dtype=torch.int32)
    GrammarMatcher.fill_bitmasks(matchers, parallel)
    for i, m in enumerate(matchers):
        m.fill_bitmask(one_by_one, i)
    assert torch.equal(parallel, one_by_one) and not torch.equal(parallel[0], parallel[2])
