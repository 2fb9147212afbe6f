"""`n` choices (routing/openai): each choice is its own sequence in the pools, with its
own request id and (given a seed) seed + index; their batches are merged as they come,
streamed under their index, summed in usage, and an error or an early exit ends them all.
`best_of` candidates are such sequences too, ranked by their tokens' summed logprob."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from engine.request import FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from routing.openai import pipeline
from routing.openai.record import Call
from routing.openai.stream import (
    ChatStream,
    ChoiceStreams,
    CompletionStream,
    best_of,
    build_completion_response,
    merge_choices,
)

pytestmark = pytest.mark.unit


def out(rid: str, text: str, finish: FinishReason | None = None, n_out: int = 1) -> RequestOutput:
    return RequestOutput(rid, [7], text, finish is not None, finish, 5, 2, n_out)


def call(n: int, seed: int | None = None) -> Call:
    return Call("chat", "chatcmpl-x", [1, 2, 3], SamplingParams(max_tokens=4, seed=seed), None, "k", "m", None, n)


def test_each_choice_is_its_own_sequence():
    one, three = call(1, seed=5), call(3, seed=5)
    assert one.to_pool(None).request_id == "chatcmpl-x" and one.cost == 3 + 4
    reqs = [three.to_pool(None, i) for i in range(3)]
    assert [r.request_id for r in reqs] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [r.sampling.seed for r in reqs] == [5, 6, 7] and three.cost == 3 + 3 * 4
    assert call(2, seed=2**63 - 1).to_pool(None, 1).sampling.seed == -(2**63)  # stays a 64-bit integer


async def _gen(items, fail: BaseException | None = None, closed: list | None = None):
    try:
        for x in items:
            await asyncio.sleep(0)
            yield x
        if fail is not None:
            raise fail
    finally:
        if closed is not None:
            closed.append(True)


async def test_merged_yields_every_batch_and_ends_all_on_error():
    a, b = [[out("a", "x")], [out("a", "y")]], [[out("b", "z")]]
    got = [o async for o in pipeline.merged([_gen(a), _gen(b)])]
    assert sorted(o[0].text for o in got) == ["x", "y", "z"]
    closed: list = []
    with pytest.raises(RuntimeError, match="boom"):
        async for _ in pipeline.merged([_gen(a, RuntimeError("boom")), _gen([[out("b", "z")]] * 1000, closed=closed)]):
            pass
    assert closed == [True]  # the other choice was closed, not left running


async def test_leaving_early_closes_every_choice():
    closed: list = []
    stream = pipeline.merged([_gen([[out(rid, "x")]] * 100, closed=closed) for rid in ("a", "b")])
    await stream.__anext__()
    await stream.aclose()
    assert closed == [True, True]


def test_streamed_choices_carry_their_index_and_summed_usage():
    streams = ChoiceStreams({f"r-{i}": ChatStream("r", "m", include_usage=True, index=i) for i in range(2)})
    events = streams.chunk([out("r-1", "B"), out("r-0", "A")]) + streams.chunk(
        [out("r-0", "a", FinishReason.STOP, 2), out("r-1", "b", FinishReason.LENGTH, 2)]) + streams.done()
    payloads = [e.removeprefix("data: ") for e in events.split("\n\n") if e]
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert text == {0: "Aa", 1: "Bb"}
    assert {c.choices[0].index: c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason} == {
        0: "stop", 1: "length"}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 4)


def test_whole_choices_are_merged_in_order():
    per_choice = [[out("r-0", "A", FinishReason.STOP, 1)], [out("r-1", "B", FinishReason.LENGTH, 3)]]
    resp = merge_choices([build_completion_response("r", "m", o) for o in per_choice])
    parsed = Completion.model_validate(resp.model_dump(exclude_none=True))
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [(0, "A", "stop"), (1, "B", "length")]
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (5, 4, 9)
    single = ChoiceStreams({"r": CompletionStream("r", "m")})
    assert json.loads(single.chunk([out("other-id", "x")]).removeprefix("data: "))["choices"][0]["text"] == "x"


def _scored(rid: str, text: str, *logprobs: float) -> list[RequestOutput]:
    """A finished candidate whose tokens have these logprobs, one output per token."""
    outs = [RequestOutput(rid, [7], text if i == 0 else "", i == len(logprobs) - 1,
                          FinishReason.LENGTH if i == len(logprobs) - 1 else None, 5, 0, i + 1,
                          [TokenLogprob(7, lp)]) for i, lp in enumerate(logprobs)]
    return outs


def test_best_of_returns_the_candidates_with_the_highest_summed_logprob_and_bills_all():
    candidates = [_scored("r-0", "A", -1.0, -1.0), _scored("r-1", "B", -0.5, -0.4), _scored("r-2", "C", -3.0, -0.1),
                  _scored("r-3", "D", -0.5, -0.4)]
    assert best_of(candidates, 1) == [1]
    assert best_of(candidates, 3) == [1, 3, 0]  # best first; the tie keeps candidate order
    responses = [build_completion_response("r", "m", c) for c in candidates]
    resp = merge_choices([responses[i] for i in best_of(candidates, 2)], billed=responses)
    parsed = Completion.model_validate(resp.model_dump(exclude_none=True))
    assert [(c.index, c.text) for c in parsed.choices] == [(0, "B"), (1, "D")]
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (5, 4 * 2)
    assert all(c.logprobs is None for c in parsed.choices)  # ranked by them, shown only when asked for


def _reqs(n: int):
    return [call(n, seed=1).to_pool(None, i) for i in range(n)]


async def test_other_choices_fork_the_first_once_it_decodes():
    """`pipeline.choices`: the first choice runs at once; the others start once it has
    produced `fork_after_tokens` tokens, and name it in `fork_of` (to fork its KV)."""
    started: list[tuple[str, str | None, int]] = []
    produced = 0

    def run(req):
        async def gen():
            nonlocal produced
            started.append((req.request_id, req.fork_of, produced))
            for i in range(3):
                await asyncio.sleep(0)
                if req.request_id.endswith("-0"):
                    produced += 1
                yield [out(req.request_id, "x", FinishReason.LENGTH if i == 2 else None)]
        return gen()

    got = [o async for o in pipeline.choices(run, _reqs(3), fork_after_tokens=2)]
    assert len(got) == 9
    assert started[0] == ("chatcmpl-x-0", None, 0)
    assert sorted(started[1:]) == [("chatcmpl-x-1", "chatcmpl-x-0", 2), ("chatcmpl-x-2", "chatcmpl-x-0", 2)]


async def test_choices_run_unforked_when_the_first_ends_before_decoding():
    """A first choice that ends at its first token (or fails) has nothing to fork: the
    others run as it did, and a failure still ends them all."""
    started: list[str | None] = []

    def run(req):
        async def gen():
            started.append(req.fork_of)
            yield [out(req.request_id, "x", FinishReason.LENGTH)]
        return gen()

    got = [o async for o in pipeline.choices(run, _reqs(2), fork_after_tokens=2)]
    assert len(got) == 2 and started == [None, None]

    def failing(req):
        async def gen():
            await asyncio.sleep(0)
            if req.request_id.endswith("-0"):
                raise RuntimeError("boom")
            yield [out(req.request_id, "x")]
        return gen()

    with pytest.raises(RuntimeError, match="boom"):
        async for _ in pipeline.choices(failing, _reqs(2), fork_after_tokens=2):
            pass
