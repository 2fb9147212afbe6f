"""Prefill and decode engine cores in their own process (engine/core_process.py,
engine/core_client.py): the KV tensor is shared memory that the replica maps
(`kv_data`), so KV written there from the replica's side (here a tensor copy, standing
in for the transfer backend's pull) is what the child's engine reads, and what a
prefill child computed is there for the replica's backend to serve. An imported or
moved-in sequence continues as it would have where it started; a sequence moved out,
or a prompt prefilled, is leased before its stream ends; an import the child refuses
frees its blocks."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from engine_steps import run

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.engine import ExportedKV, MovedSequence
from engine.errors import InvalidRequest
from engine.request import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput

pytestmark = [pytest.mark.unit, pytest.mark.model]

CFG = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=512)
PROMPT = [{"role": "user", "content": "Write three sentences about the sea."}]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "pop": {"type": "integer"}},
          "required": ["city", "pop"], "additionalProperties": False}
STRUCTURED = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput.json_schema(SCHEMA))


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient(CFG, "decode", threads=1)
    yield client
    client.shutdown()


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


async def _collect(stream) -> list[RequestOutput]:
    return [o async for outs in stream for o in outs]


async def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


def _all_free(core: EngineCoreClient) -> bool:
    return core.stats.num_requests == 0 and core.stats.kv_blocks_free == core.stats.kv_blocks_total


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, STRUCTURED], ids=["greedy", "seeded", "structured"])
async def test_a_sequence_moved_into_the_child_continues_as_if_it_had_stayed(core, make_engine, sampling):
    src, ref = make_engine(), make_engine()
    question = "The largest city of France, as JSON." if sampling.structured else PROMPT[0]["content"]
    prompt = ref.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    ref.add_request(prompt, sampling, request_id="r")
    want = _tokens(run(ref, "r"))

    src.add_request(prompt, sampling, request_id="r")
    before = run(src, "r", n_steps=9)
    seq = src.move_out("r")
    assert seq is not None
    blocks = await core.reserve_blocks(seq.num_computed_tokens)
    assert blocks is not None and len(blocks) == len(seq.block_ids)
    core.kv_data[blocks] = src.kv_cache.data[seq.block_ids]  # the pull, into the child's pages
    stream = await core.add_imported_request("r", seq.token_ids[:-1], seq.token_ids[-1], sampling,
                                             lambda: blocks, resume=seq.resume)
    after = await _collect(stream)
    assert _tokens(before) + _tokens(after) == want
    if sampling.structured:  # the grammar went on from where the move left it
        assert "".join(o.text for o in before + after).startswith('{"city": ')
    await _wait_for(lambda: _all_free(core))


async def test_a_sequence_moved_out_of_the_child_is_leased_before_its_stream_ends(core, make_engine):
    dst, ref = make_engine(), make_engine()
    prompt = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(PROMPT))
    ref.add_request(prompt, GREEDY, request_id="m")
    want = _tokens(run(ref, "m"))

    leased: list[MovedSequence] = []
    stream = await core.add_request("m", prompt, GREEDY)
    before: list[RequestOutput] = []
    async for outs in stream:
        if not before:  # decoding now: move it out
            assert await core.move_out(["m", "not-here"], leased.append) == ["m"]
        for o in outs:
            if o.finish_reason is FinishReason.MOVED:
                assert leased, "the stream ended before its sequence was leased"
            else:
                before.append(o)
    assert [o.request_id for o in leased] == ["m"]
    seq = leased[0]
    blocks = dst.reserve_import(seq.num_computed_tokens)
    dst.kv_cache.data[blocks] = core.kv_data[seq.block_ids]  # another replica's pull
    core.release_blocks(seq.block_ids).result(timeout=60)  # its lease ended
    dst.add_imported_request("m", seq.token_ids[:-1], seq.token_ids[-1], GREEDY, blocks, resume=seq.resume)
    assert _tokens(before) + _tokens(run(dst, "m")) == want
    await _wait_for(lambda: _all_free(core))  # the stats arrive without a step


async def test_an_import_the_child_refuses_frees_its_blocks_and_the_others_carry_on(core):
    good = asyncio.create_task(_collect(await core.add_request("ok", [1, *range(100, 140)], GREEDY)))
    blocks = await core.reserve_blocks(64)
    assert blocks is not None
    with pytest.raises(InvalidRequest) as e:
        await core.add_imported_request("bad", [10**9] * 63, 5, GREEDY, lambda: blocks)
    assert e.value.field == "prompt"
    assert len(_tokens(await good)) == GREEDY.max_tokens
    await _wait_for(lambda: _all_free(core))
    core.check_health()


async def test_reserving_more_than_is_free_gets_none_and_the_pool_says_what_it_could_ever_hold(core):
    assert core.could_ever_hold(512 * CFG.block_size) and not core.could_ever_hold(512 * CFG.block_size + 1)
    assert await core.reserve_blocks(512 * CFG.block_size + 1) is None
    await _wait_for(lambda: _all_free(core))


async def test_a_prefill_child_leases_its_export_before_the_output_and_its_kv_is_the_engines(make_engine):
    ref = make_engine(role="prefill")
    prompt = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(PROMPT))
    ref.add_request(prompt, GREEDY, request_id="p")
    (want,) = [o for o in run(ref, "p") if o.finished]
    ref_blocks = ref.take_export("p").block_ids

    exports: list[ExportedKV] = []
    core = EngineCoreClient(CFG, "prefill", threads=1, on_export=exports.append)
    try:
        outs = await _collect(await core.add_request("p", prompt, GREEDY))
        assert [e.request_id for e in exports] == ["p"], "the output arrived before its export was leased"
        assert outs[-1].finish_reason is FinishReason.PREFILL_DONE and outs[-1].new_token_ids == want.new_token_ids
        (export,) = exports
        assert export.num_tokens == len(prompt) and len(export.block_ids) == len(ref_blocks)
        n = len(prompt) % CFG.block_size or CFG.block_size  # the last block's filled slots
        got, ref_kv = core.kv_data[export.block_ids], ref.kv_cache.data[ref_blocks]
        assert torch.allclose(got[:-1], ref_kv[:-1], atol=1e-5)
        assert torch.allclose(got[-1, :, :, :n], ref_kv[-1, :, :, :n], atol=1e-5)
        assert core.stats.kv_blocks_free < core.stats.kv_blocks_total  # pinned until the lease ends
        core.release_blocks(export.block_ids).result(timeout=60)
        # The next prompts (one of them a prefix-cache hit) are leased the same way.
        for rid in ("again", "other"):
            await _collect(await core.add_request(rid, prompt if rid == "again" else prompt[:-3], GREEDY))
            assert exports[-1].request_id == rid
            core.release_blocks(exports[-1].block_ids).result(timeout=60)
        await _wait_for(lambda: _all_free(core))
    finally:
        core.shutdown()


def test_a_prefill_child_without_a_lessee_is_refused():
    with pytest.raises(ValueError, match="on_export"):
        EngineCoreClient(CFG, "prefill", threads=1)
