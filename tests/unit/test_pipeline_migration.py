"""The gateway pipeline survives lost replicas (routing/openai/pipeline.py), with real
engines behind fake Serve handles: a decode replica lost mid-stream migrates the
request (greedy output unchanged, usage as if nothing happened); a prefill replica
lost before answering is retried; past the limits the request fails cleanly."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from ray.exceptions import ActorDiedError

from autoscaling.placement import DisaggregationConfig, Placement, Where
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from kvtransfer.backends.base import PeerInfo
from kvtransfer.layout import LayoutFingerprint
from kvtransfer.messages import (
    DecodeRequest,
    ImportFailed,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    RejectReason,
    SequenceMoved,
)
from routing.openai import pipeline
from routing.openai.errors import APIError

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
FP = LayoutFingerprint("m", "float32", 16, 1, 1, 8)


def _handle(request_id: str, n: int, lease_s: float = 30.0) -> KVHandle:
    # No control address: releasing or rejecting it is a no-op here.
    return KVHandle(request_id, "prefill#x", "fake", PeerInfo("p", FP, 64), tuple(range(-(-n // 16))), n, FP, "lease",
                    time.time() + lease_s)


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Response:
    """A unary Serve call's response: awaited for its result, and cancellable."""

    def __init__(self, coro):
        self.coro, self.cancelled = coro, False

    def __await__(self):
        return self.coro.__await__()

    def cancel(self):
        self.cancelled = True


class FakePrefill:
    """`prefill.remote(PrefillRequest)`: the engine computes the prompt and samples one token."""

    def __init__(self, engine, die_times: int = 0, lease_s: float = 30.0, then_queue: bool = False):
        """`then_queue`: after its deaths, a call is never answered (Serve queues it
        while the pool has no live replica)."""
        self.engine, self.die_times, self.calls, self.lease_s = engine, die_times, [], lease_s
        self.then_queue = then_queue
        self.responses: list[_Response] = []
        self.prefill = _Remote(self._call)

    def _call(self, req: PrefillRequest) -> _Response:
        self.responses.append(_Response(self._prefill(req)))
        return self.responses[-1]

    async def _prefill(self, req: PrefillRequest):
        request_id, prompt_ids, sp = req.request_id, req.prompt_token_ids, req.sampling
        self.calls.append((request_id, list(prompt_ids), sp.max_tokens))
        if self.die_times:
            self.die_times -= 1
            raise ActorDiedError()
        if self.then_queue:
            await asyncio.Event().wait()
        self.engine.add_request(list(prompt_ids), SamplingParams(**{**vars(sp), "max_tokens": 1}),
                                request_id=request_id)
        out = None
        while self.engine.has_unfinished():
            out = self.engine.step()[-1]
        return PrefillResult(request_id, out.new_token_ids[0], _handle(request_id, len(prompt_ids), self.lease_s),
                             out.num_cached_tokens, len(prompt_ids), text=out.text)


class _Stream:
    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self.agen

    def cancel(self):
        pass


class FakeDecode:
    """`options(stream=True).generate.remote(req)`: continues after the first token;
    the first `die_after` streams break after that many tokens (a lost replica)."""

    def __init__(self, engine, die_after: list[int], import_fails: list[str] = ()):
        self.engine, self.die_after, self.requests = engine, list(die_after), []
        self.import_fails = list(import_fails)  # the first imports fail with these reasons
        self.generate = _Remote(self._generate)

    def options(self, stream: bool):
        return self

    def _generate(self, req):
        self.requests.append(req)
        limit = self.die_after.pop(0) if self.die_after else None
        fail = self.import_fails.pop(0) if self.import_fails else None
        return _Stream(self._run(req, limit, fail))

    async def _run(self, req, limit, import_fail=None):
        if import_fail is not None:
            raise ImportFailed(import_fail, "the prefill replica is gone")
        e = self.engine
        if isinstance(req, PrefillRequest):  # prefilled here (router.disaggregation)
            e.add_request(list(req.prompt_token_ids), req.sampling, request_id=req.request_id)
        else:  # as a decode replica whose import failed: the prompt recomputed, the first token adopted
            e.add_imported_request(req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, None)
        sent = 0
        while e.has_unfinished():
            for out in e.step():
                if limit is not None and sent == limit:
                    e.abort(req.request_id)
                    raise ActorDiedError()
                sent += 1
                yield [out]


def pools(decode, elsewhere=None) -> pipeline.DecodePools:
    """Fake decode deployments as the pipeline sees them: behind their handles."""
    first = pipeline.RemotePool(decode)
    return pipeline.DecodePools(first, first if elsewhere is None else pipeline.RemotePool(elsewhere))


async def collect(gen):
    return [o async for outs in gen for o in outs]


@pytest.fixture
def prompt(engine):
    return engine.tokenizer.encode("The capital of France is")


def request(prompt: list[int], request_id: str = "req") -> PrefillRequest:
    return PrefillRequest(request_id, tuple(prompt), GREEDY)


@pytest.fixture
def reference(make_engine, prompt):
    e = make_engine()
    e.add_request(list(prompt), GREEDY, request_id="ref")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    return [t for o in outs for t in o.new_token_ids]


async def test_a_lost_decode_replica_migrates_the_request(make_engine, prompt, reference):
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[10])
    timing = pipeline.Timing()
    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt), timing, resilience=pipeline.Resilience(max_migrations=1)))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert timing.migrations == 1
    # the continuation re-prefilled the prompt + the 11 tokens streamed (1 from prefill, 10 from decode)
    assert prefill.calls[1] == ("req.m1", prompt + reference[:11], GREEDY.max_tokens - 11)
    last = outs[-1]
    assert (last.request_id, last.num_prompt_tokens, last.num_output_tokens) == ("req", len(prompt), GREEDY.max_tokens)
    assert last.finished and last.finish_reason == FinishReason.LENGTH


async def test_a_migrated_structured_request_resumes_its_document(make_engine):
    """The continuation's grammar starts where the streamed tokens left it: the output is
    the uninterrupted one, a complete JSON document."""
    engine = make_engine()
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}]))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    sp = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput.json_schema(schema))
    want = engine.generate([prompt], sp)[0]
    decode = FakeDecode(make_engine(), die_after=[4])
    outs = await collect(pipeline.disaggregated(FakePrefill(engine), pools(decode),
                                                PrefillRequest("req", tuple(prompt), sp), pipeline.Timing(),
                                                resilience=pipeline.Resilience(max_migrations=1)))
    got = [t for o in outs for t in o.new_token_ids]
    assert got == want.token_ids and outs[-1].finish_reason == FinishReason.STOP
    assert set(json.loads(engine.tokenizer.decode(got))) == {"name", "age"}
    # the continuation carried the 5 streamed tokens as the grammar's prefix
    assert decode.requests[1].sampling.structured.prefix == tuple(got[:5])


async def test_past_the_migration_limit_the_request_fails(make_engine, prompt):
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[3, 3])
    with pytest.raises(pipeline.UpstreamError, match=r"decode failed \(migration limit 1 reached\)"):
        await collect(pipeline.disaggregated(
            prefill, pools(decode), request(prompt), pipeline.Timing(), resilience=pipeline.Resilience(1)))
    with pytest.raises(pipeline.UpstreamError):
        await collect(pipeline.disaggregated(
            FakePrefill(make_engine()), pools(FakeDecode(make_engine(), die_after=[3])), request(prompt),
            pipeline.Timing()))  # no migrations allowed


async def test_a_lost_prefill_replica_is_retried(make_engine, prompt, reference):
    prefill, decode = FakePrefill(make_engine(), die_times=1), FakeDecode(make_engine(), die_after=[])
    timing = pipeline.Timing()
    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt), timing, resilience=pipeline.Resilience(prefill_retries=1)))
    assert [t for o in outs for t in o.new_token_ids] == reference and timing.prefill_retries == 1


async def test_with_no_prefill_replica_to_answer_the_pass_prefills_where_it_decodes(make_engine, prompt, reference):
    """Every try found its prefill replica gone (a pool of one whose engine core is being
    replaced, or no replica at all): the decode replica computes the prompt itself,
    and the placement says why."""
    prefill, decode = FakePrefill(make_engine(), die_times=2), FakeDecode(make_engine(), die_after=[])
    placed: list[Placement] = []
    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt, "req2"), pipeline.Timing(),
        resilience=pipeline.Resilience(prefill_retries=1), placed=placed.append))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert len(prefill.calls) == 2 and isinstance(decode.requests[0], PrefillRequest)
    assert placed[-1] == Placement(Where.LOCAL, "prefill_unavailable")


async def test_a_retry_no_prefill_replica_answers_is_prefilled_where_it_decodes(make_engine, prompt, reference):
    """The pool's only replica died and Serve queues the retry until a new one starts:
    past `prefill_retry_wait_s` the retry is cancelled and decode computes the prompt."""
    prefill = FakePrefill(make_engine(), die_times=1, then_queue=True)
    decode = FakeDecode(make_engine(), die_after=[])
    placed: list[Placement] = []
    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt, "req3"), pipeline.Timing(),
        resilience=pipeline.Resilience(prefill_retries=1, prefill_retry_wait_s=0.2), placed=placed.append))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert len(prefill.calls) == 2 and prefill.responses[1].cancelled
    assert placed[-1] == Placement(Where.LOCAL, "prefill_unavailable")


async def test_with_the_prefill_pool_known_empty_the_pass_goes_local_at_once(make_engine, prompt, reference):
    """The prefill router has no replica left (Serve would queue the call until one is
    replaced): no prefill call is made at all."""
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[])
    placed: list[Placement] = []
    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt, "req4"), pipeline.Timing(), placed=placed.append,
        prefill_reachable=lambda: False))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert prefill.calls == [] and isinstance(decode.requests[0], PrefillRequest)
    assert placed == [Placement(Where.LOCAL, "prefill_unavailable")]


async def test_a_call_waiting_when_the_prefill_pool_empties_goes_local(make_engine, prompt, reference):
    """The call went out while a replica was there; the replica died before it answered
    and Serve queues the call: once the router's set is empty the call is cancelled."""
    prefill = FakePrefill(make_engine(), then_queue=True)
    decode = FakeDecode(make_engine(), die_after=[])
    asked: list[bool] = []

    def reachable() -> bool:  # the second look finds the pool empty
        asked.append(True)
        return len(asked) < 2

    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt, "req5"), pipeline.Timing(), prefill_reachable=reachable))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert len(prefill.calls) == 1 and prefill.responses[0].cancelled and isinstance(decode.requests[0], PrefillRequest)


async def test_kv_lost_with_its_prefill_replica_is_prefilled_again(make_engine, prompt, reference):
    # The prefill replica answered, then died before decode pulled the KV: nothing was
    # decoded, so prefill runs again (prompt + the first token) and decode goes on.
    prefill = FakePrefill(make_engine())
    decode = FakeDecode(make_engine(), die_after=[], import_fails=[RejectReason.TRANSFER_FAILED])
    timing = pipeline.Timing()
    outs = await collect(pipeline.disaggregated(
        prefill, pools(decode), request(prompt), timing, resilience=pipeline.Resilience(prefill_retries=1)))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert (timing.prefill_retries, timing.migrations) == (1, 0)
    assert prefill.calls[1] == ("req.m1", prompt + reference[:1], GREEDY.max_tokens - 1)
    assert outs[-1].num_output_tokens == GREEDY.max_tokens and outs[-1].request_id == "req"


@pytest.mark.parametrize("reason, retries", [(RejectReason.TRANSFER_FAILED, 0), (RejectReason.NO_FREE_BLOCKS, 1),
                                             (RejectReason.LAYOUT_MISMATCH, 1)])
async def test_import_failures_that_are_not_retried_fail_the_request(make_engine, prompt, reason, retries):
    # Out of retries, or a failure another prefill would not cure (capacity, config).
    decode = FakeDecode(make_engine(), die_after=[], import_fails=[reason, reason])
    with pytest.raises(pipeline.UpstreamError, match=reason) as err:
        await collect(pipeline.disaggregated(FakePrefill(make_engine()), pools(decode), request(prompt),
                                             pipeline.Timing(), resilience=pipeline.Resilience(1, retries)))
    assert err.value.capacity == (reason == RejectReason.NO_FREE_BLOCKS)
    assert len(decode.requests) == 1


def test_nothing_left_to_generate_after_a_loss_ends_the_request():
    assert pipeline._remaining(GREEDY, list(range(GREEDY.max_tokens))) is None
    assert pipeline._remaining(GREEDY, [1, 2, 3, 4]).max_tokens == GREEDY.max_tokens - 4


class _NeverStarted:
    """A decode call Serve never assigns (no live replica): its stream waits forever."""

    def __init__(self):
        self.cancelled = False
        self.generate = _Remote(lambda req: self)

    def options(self, stream: bool):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


async def test_a_decode_call_no_replica_starts_fails_once_its_lease_is_over(make_engine, prompt):
    prefill, decode = FakePrefill(make_engine(), lease_s=0.1), _NeverStarted()
    resilience = pipeline.Resilience(decode_start_grace_s=0.2)
    with pytest.raises(pipeline.UpstreamError, match="no decode replica started the request") as e:
        await collect(pipeline.disaggregated(prefill, pools(decode), request(prompt), pipeline.Timing(), resilience))
    assert e.value.capacity  # a 503: retry later
    assert decode.cancelled  # the Serve call is withdrawn


async def test_a_client_that_leaves_mid_decode_cancels_the_call_and_rejects_the_lease(make_engine, prompt,
                                                                                         monkeypatch):
    rejected = []
    monkeypatch.setattr("kvtransfer.handoff.reject_lease",
                        lambda handle, reason, timeout_s: rejected.append((handle.request_id, reason)))
    streams = []

    class Decode(FakeDecode):
        def _generate(self, req):
            stream = super()._generate(req)
            stream.cancelled = False
            stream.cancel = lambda: setattr(stream, "cancelled", True)
            streams.append(stream)
            return stream

    gen = pipeline.disaggregated(FakePrefill(make_engine()), pools(Decode(make_engine(), die_after=[])),
                                 request(prompt), pipeline.Timing())
    got = [await gen.__anext__() for _ in range(3)]  # the first token, then two from decode
    assert len(got) == 3
    await gen.aclose()  # the client went away
    assert streams[0].cancelled
    assert rejected == [("req", RejectReason.CLIENT_DISCONNECTED)]


async def test_a_request_out_of_time_during_prefill_cancels_the_prefill_call(make_engine, prompt):
    """The deadline (504) or a client that leaves while the prompt is computed: the
    prefill call is cancelled, so its replica does not go on to lease KV to nobody."""

    class Slow(FakePrefill):
        async def _prefill(self, req):
            await asyncio.Event().wait()  # still computing when the request runs out of time

    prefill = Slow(make_engine())
    gen = pipeline.within(pipeline.disaggregated(prefill, pools(FakeDecode(make_engine(), die_after=[])),
                                                 request(prompt), pipeline.Timing()), timeout_s=0.2)
    with pytest.raises(APIError, match="did not finish within 0.2 s") as e:
        await collect(gen)
    assert e.value.status == 504
    assert [r.cancelled for r in prefill.responses] == [True]


async def test_a_finished_request_leaves_its_lease_to_decode(make_engine, prompt, monkeypatch):
    rejected = []
    monkeypatch.setattr("kvtransfer.handoff.reject_lease", lambda *a, **k: rejected.append(a))
    await collect(pipeline.disaggregated(FakePrefill(make_engine()), pools(FakeDecode(make_engine(), die_after=[])),
                                         request(prompt), pipeline.Timing()))
    assert rejected == []  # decode released it


async def test_a_decode_replica_lost_after_the_final_output_is_not_a_migration(make_engine, prompt, reference):
    class DiesAfterTheEnd(FakeDecode):
        async def _run(self, req, limit, import_fail=None):
            async for outs in super()._run(req, None):
                yield outs
            raise ActorDiedError()  # the replica went away before the stream's end was read

    prefill = FakePrefill(make_engine())
    timing = pipeline.Timing()
    outs = await collect(pipeline.disaggregated(prefill, pools(DiesAfterTheEnd(make_engine(), die_after=[])),
                                                request(prompt), timing,
                                                resilience=pipeline.Resilience(max_migrations=1)))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert timing.migrations == 0 and len(prefill.calls) == 1


AUTO = DisaggregationConfig(mode="auto", max_local_prompt_tokens=64)


async def test_auto_prefills_a_short_prompt_where_it_decodes(make_engine, prompt, reference):
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[])
    placed: list[Placement] = []
    outs = await collect(pipeline.disaggregated(prefill, pools(decode), request(prompt), pipeline.Timing(),
                                                placement=AUTO, placed=placed.append))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert prefill.calls == [] and isinstance(decode.requests[0], PrefillRequest)
    assert placed == [Placement(Where.LOCAL, "short_prompt")]
    assert outs[-1].finished and outs[-1].num_output_tokens == GREEDY.max_tokens


async def test_auto_sends_a_long_prompt_through_prefill(make_engine, prompt):
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[])
    placed: list[Placement] = []
    short = DisaggregationConfig(mode="auto", max_local_prompt_tokens=len(prompt) - 1)
    await collect(pipeline.disaggregated(prefill, pools(decode), request(prompt), pipeline.Timing(), placement=short,
                                         placed=placed.append))
    assert len(prefill.calls) == 1 and not isinstance(decode.requests[0], PrefillRequest)
    assert placed == [Placement(Where.REMOTE, "long_prompt")]


async def test_a_local_pass_whose_replica_is_lost_migrates(make_engine, prompt, reference):
    """The continuation is placed again (prompt + the 10 tokens streamed: still short)."""
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[10])
    timing, placed = pipeline.Timing(), []
    outs = await collect(pipeline.disaggregated(prefill, pools(decode), request(prompt), timing,
                                                pipeline.Resilience(max_migrations=1), AUTO, placed.append))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert timing.migrations == 1 and prefill.calls == []
    assert [tuple(r.prompt_token_ids) for r in decode.requests] == [tuple(prompt), tuple(prompt + reference[:10])]
    assert [p.where for p in placed] == [Where.LOCAL, Where.LOCAL]
    last = outs[-1]
    assert (last.request_id, last.num_prompt_tokens, last.num_output_tokens) == ("req", len(prompt), GREEDY.max_tokens)


async def test_a_local_pass_past_the_migration_limit_fails_cleanly(make_engine, prompt):
    decode = FakeDecode(make_engine(), die_after=[3])
    with pytest.raises(pipeline.UpstreamError, match="decode failed"):
        await collect(pipeline.disaggregated(FakePrefill(make_engine()), pools(decode), request(prompt),
                                             pipeline.Timing(), pipeline.Resilience(max_migrations=0), AUTO))


async def test_a_request_that_ended_at_prefill_without_a_token_is_one_final_output():
    """A structured request whose grammar dead-ends at its first token: prefill returns
    no token and no lease, and the client gets a finished output with nothing in it."""

    class DeadEnd:
        def __init__(self):
            self.prefill = _Remote(self._prefill)

        async def _prefill(self, req):
            return PrefillResult(req.request_id, None, None, 0, len(req.prompt_token_ids),
                                 finish_reason=FinishReason.GRAMMAR_DEAD_END)

    outs = await collect(pipeline.disaggregated(DeadEnd(), pools(None), request([1, 2, 3]), pipeline.Timing()))
    assert len(outs) == 1 and outs[0].finished and outs[0].new_token_ids == []
    assert outs[0].finish_reason == FinishReason.GRAMMAR_DEAD_END and outs[0].num_output_tokens == 0


class DrainingDecode:
    """Two decode replicas: the first (`a`) drains after streaming `move_after` tokens
    of the first request it gets and hands its sequence on (a real `Engine.move_out`, its blocks
    under a lease); the second (`b`) imports a moved sequence by copying those blocks
    and continues it. `fail_move_import`: the second's import of it fails instead."""

    def __init__(self, a, b, move_after: int, fail_move_import: bool = False):
        self.a, self.b, self.move_after, self.fail = a, b, move_after, fail_move_import
        self.requests, self.leased = [], {}
        self.generate = _Remote(lambda req: _Stream(self._run(req)))

    def options(self, stream: bool):
        return self

    async def _run(self, req):
        self.requests.append(req)
        if isinstance(req, DecodeRequest) and req.resume is not None:
            async for outs in self._continue(req):
                yield outs
            return
        a = self.a
        if isinstance(req, PrefillRequest):
            a.add_request(list(req.prompt_token_ids), req.sampling, request_id=req.request_id)
        else:
            a.add_imported_request(req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, None)
        sent = 0
        if len(self.requests) > 1:  # drained once: later calls run to their end
            self.move_after = 10**9
        while sent < self.move_after or not a.move_out_ready(req.request_id):
            if not a.has_unfinished():
                return
            outs = a.step()
            sent += sum(len(o.new_token_ids) for o in outs)
            yield outs
        seq = a.move_out(req.request_id)
        handle = _handle(req.request_id, seq.num_computed_tokens)
        self.leased[handle.lease_id] = seq
        assert [o.finish_reason for o in a.step()] == [FinishReason.MOVED]
        yield SequenceMoved(DecodeRequest(req.request_id, tuple(seq.token_ids[:-1]), seq.token_ids[-1],
                                          req.sampling, handle, resume=seq.resume), "decode#a")

    async def _continue(self, req):
        seq = self.leased.pop(req.kv_handle.lease_id)
        if self.fail:
            self.a.release_blocks(seq.block_ids)
            raise ImportFailed(RejectReason.TRANSFER_FAILED, "the draining replica is gone")
        b = self.b
        blocks = b.reserve_import(req.kv_handle.num_tokens)
        b.kv_cache.data[blocks] = self.a.kv_cache.data[seq.block_ids]
        self.a.release_blocks(seq.block_ids)
        b.add_imported_request(req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, blocks,
                               resume=req.resume)
        while b.has_unfinished():
            yield b.step()


def _move_out_ready(engine, request_id):
    req = engine.scheduler.requests.get(request_id)
    return req is not None and req.num_computed_tokens == req.num_tokens - 1


@pytest.fixture
def draining(make_engine):
    def make(**kw):
        a = make_engine()
        a.move_out_ready = lambda rid: _move_out_ready(a, rid)
        return DrainingDecode(a, make_engine(), **kw)
    return make


@pytest.mark.parametrize("where", ["remote", "local"])
async def test_a_draining_decode_replica_hands_the_sequence_on_without_a_prefill(draining, make_engine, prompt,
                                                                                 reference, where):
    prefill, decode = FakePrefill(make_engine()), draining(move_after=7)
    timing = pipeline.Timing()
    placement = DisaggregationConfig(mode="auto", max_local_prompt_tokens=64 if where == "local" else 1)
    outs = await collect(pipeline.disaggregated(prefill, pools(decode), request(prompt), timing, placement=placement))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert (timing.moves, timing.migrations, timing.prefill_retries) == (1, 0, 0)
    assert len(prefill.calls) == (0 if where == "local" else 1)  # nothing was prefilled again
    moved = decode.requests[1]
    assert moved.resume is not None and moved.request_id == "req"
    last = outs[-1]
    assert (last.request_id, last.num_output_tokens, last.finish_reason) == ("req", GREEDY.max_tokens,
                                                                               FinishReason.LENGTH)
    assert not decode.a.has_unfinished() and decode.a.block_pool.num_free_blocks == decode.a.block_pool.num_blocks


async def test_a_moved_sequence_whose_kv_does_not_arrive_is_recomputed(draining, make_engine, prompt, reference):
    prefill, decode = FakePrefill(make_engine()), draining(move_after=5, fail_move_import=True)
    timing = pipeline.Timing()
    outs = await collect(pipeline.disaggregated(prefill, pools(decode), request(prompt), timing,
                                                resilience=pipeline.Resilience(max_migrations=1)))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert (timing.moves, timing.migrations) == (1, 1)
    assert prefill.calls[1][0] == "req.m1"  # recomputed from prompt + what was streamed


class Via:
    """A decode pool that records the calls it carries to `target` (another fake)."""

    def __init__(self, target):
        self.target, self.requests = target, []
        self.generate = _Remote(self._generate)

    def options(self, stream: bool):
        return self

    def _generate(self, req):
        self.requests.append(req)
        return self.target.generate.remote(req)


@pytest.mark.parametrize("where", ["remote", "local"])
async def test_the_ingress_replica_decodes_the_first_pass_and_hands_a_drained_sequence_to_the_others(
        draining, make_engine, prompt, reference, where):
    """P/D mode: the decode engine of the replica the gateway runs in takes the request
    (`DecodePools.first`); the sequence it hands on as it drains goes to the deployment."""
    prefill, decode = FakePrefill(make_engine()), draining(move_after=7)
    here, others = Via(decode), Via(decode)
    timing = pipeline.Timing()
    placement = DisaggregationConfig(mode="auto", max_local_prompt_tokens=64 if where == "local" else 1)
    outs = await collect(pipeline.disaggregated(prefill, pools(here, others), request(prompt), timing,
                                                placement=placement))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert [type(r) for r in here.requests] == [PrefillRequest if where == "local" else DecodeRequest]
    assert len(others.requests) == 1 and others.requests[0].resume is not None
    assert timing.moves == 1


async def test_an_ingress_replica_whose_engine_is_lost_migrates_the_request_to_the_others(
        make_engine, prompt, reference):
    prefill = FakePrefill(make_engine())
    here, others = FakeDecode(make_engine(), die_after=[10]), FakeDecode(make_engine(), die_after=[])
    timing = pipeline.Timing()
    outs = await collect(pipeline.disaggregated(prefill, pools(here, others), request(prompt), timing,
                                                resilience=pipeline.Resilience(max_migrations=1)))
    assert [t for o in outs for t in o.new_token_ids] == reference
    assert timing.migrations == 1 and len(here.requests) == 1 and len(others.requests) == 1
    assert others.requests[0].request_id == "req.m1"


async def test_a_remote_decode_pool_asks_for_its_handle_once_at_first_use(make_engine, prompt, reference):
    """A decode replica's way to the other decode replicas: the handle to its own
    deployment cannot be bound into the app, so it is asked for when first needed."""
    made = []

    def handle():
        made.append(FakeDecode(make_engine(), die_after=[]))
        return made[-1]

    remote = pipeline.RemotePool(handle)
    assert made == []
    for rid in ("a", "b"):
        outs = [o async for batch in remote.generate(request(prompt, rid)) for o in batch]
        assert [t for o in outs for t in o.new_token_ids] == reference
    assert len(made) == 1 and len(made[0].requests) == 2


async def test_the_decode_call_starts_while_the_first_token_goes_to_the_client(make_engine, prompt):
    """The KV pull begins as soon as prefill answers, not when the client asks for the
    chunk after the first token (a slow reader must not delay the handoff)."""
    prefill, decode = FakePrefill(make_engine()), FakeDecode(make_engine(), die_after=[])
    stream = pipeline.disaggregated(prefill, pools(decode), request(prompt), pipeline.Timing())
    try:
        first = await stream.__anext__()
        assert first[0].num_output_tokens == 1  # the prefill's token
        for _ in range(100):  # a few turns of the event loop, nothing asked of the stream
            if decode.requests:
                break
            await asyncio.sleep(0)
        assert [type(r) for r in decode.requests] == [DecodeRequest]
    finally:
        await stream.aclose()
