"""The path of one request behind the gateway, as a stream of output batches.

Disaggregated: a loop of passes (`disaggregated`); one pass (`_Pass`) is prefill →
(first token to the client at once) → decode, which imports the KV and streams the
rest; a pass that did not finish the request ends its stream with an `Ended` that
says what comes next: migrate, or prefill again. Each pass is placed first
(`router.disaggregation`, autoscaling/placement.py): a pass whose prompt is cheaper
to compute where it decodes is a `_LocalPass`, the whole request on one decode
replica. Aggregated: one pool does both.

Whatever ends the stream early (client gone, replica dead) is handled here: in-flight
Serve calls are cancelled, and a lease nobody will pull is rejected (`LeaseGuard`) so
prefill frees it now rather than at TTL. Nothing here reads gateway state: it runs
wherever the request's stream is served.

Replicas that die are survived here. A prefill replica that dies before answering:
the call is tried on another one (`gateway.prefill_retries`); when none answers, the
pass prefills where it decodes. A decode replica that
dies mid-stream: the request migrates (`gateway.max_migrations`): prefill computes
prompt + the tokens already streamed (its prefix cache and the KV tier hold most of
it), samples the next token, and another decode replica continues; the client sees
one unbroken stream. Greedy output is the same as without the failure; seeded
sampling and penalties restart from the migrated context (documented limits). A decode
replica that cannot import the KV because its source is gone (the prefill replica died
after answering, or the lease ran out) has decoded nothing: the request is prefilled
again elsewhere, within the same `gateway.prefill_retries`.

Replicas that drain hand their work on. A decode replica Serve stops (scale-down,
rolling update) ends each decoding stream with a `SequenceMoved`: the next decode
replica imports the sequence's KV from it, as from a prefill, and continues with its
sampler, detokenizer and grammar state (`_Decoding`): no prefill, nothing recomputed,
greedy and seeded output as if nothing happened. A moved sequence whose KV does not
arrive is recomputed elsewhere as a migration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve._private.utils import generate_request_id
from ray.serve.context import _set_request_context

from autoscaling.placement import ClusterView, DisaggregationConfig, Placement, Where, choose_placement
from engine.request import EngineDead, FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.config import TransferConfig
from kvtransfer.handoff import LeaseGuard
from kvtransfer.messages import (
    DecodeRequest,
    ImportFailed,
    PrefillRequest,
    PrefillResult,
    RejectReason,
    SequenceMoved,
)
from routing.openai.config import GatewayConfig
from routing.openai.errors import deadline_exceeded

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """A pool failed the request: 503 when it was out of capacity (decode had no free
    KV blocks; retrying later can succeed), 500 otherwise (replica died, import failed)."""

    def __init__(self, message: str, capacity: bool = False):
        super().__init__(message)
        self.capacity = capacity


class PrefillUnavailable(UpstreamError):
    """Every prefill call of a pass found its replica (or its engine) gone: the pass
    prefills where it decodes instead (`_Pass.run`)."""


# A lease the gateway gives up is freed by its TTL anyway: never wait long to say so.
_REJECT_TIMEOUT_S = 1.0
# Errors that mean the replica (or its engine) is gone, not that the request is bad.
_REPLICA_GONE = (RayActorError, ActorUnavailableError, EngineDead)
# Import failures that mean the prompt's KV is gone, not that decode cannot take it.
_SOURCE_LOST = (RejectReason.TRANSFER_FAILED, RejectReason.LEASE_EXPIRED)
# Past its lease a decode call cannot import the KV any more, so one that has not
# produced its first output by then never will (Serve queues a call while the pool
# has no live replica: a lost node, nowhere to place a new one). A pull begun just
# before the lease ended is bounded by `transfer.timeout_s`; this much more covers
# the import and the first step (`Resilience.decode_start_grace_s`).
_DECODE_START_MARGIN_S = 5.0


def grace_after_lease(transfer_timeout_s: float) -> float:
    """How long past its lease a decode call may take to produce its first output: the
    longest pull plus the margin for the import and the first step."""
    return transfer_timeout_s + _DECODE_START_MARGIN_S


# Every request through the prefill pool (router.disaggregation's default).
_ALWAYS = DisaggregationConfig()


@dataclass
class Timing:
    """When one request started (monotonic seconds), and what it survived."""

    start: float = field(default_factory=time.monotonic)
    migrations: int = 0
    prefill_retries: int = 0
    moves: int = 0  # times a draining decode replica handed the sequence on, KV and all


@dataclass(frozen=True)
class Resilience:
    """How many replica deaths one request may survive (`gateway:` settings), and how
    long past its lease a decode call may take to produce its first output before
    the pass counts as lost: the longest pull (`transfer.timeout_s`) plus a margin."""

    max_migrations: int = 0
    prefill_retries: int = 0
    decode_start_grace_s: float = grace_after_lease(TransferConfig().timeout_s)
    # How long a prefill retry may wait for an answer before the pass prefills locally.
    prefill_retry_wait_s: float = GatewayConfig().prefill_retry_wait_s


class Outcome(StrEnum):
    """How one prefill → decode pass ended."""

    DONE = "done"  # the request ended (decode streamed it to the end, or prefill finished it)
    MIGRATE = "migrate"  # the decode replica was lost mid-stream: continue from what was streamed
    REPREFILL = "reprefill"  # decode could not import the KV (its source is gone): prefill again


@dataclass(frozen=True)
class Ended:
    """The last item of a pass's stream that did not finish the request: how it ended
    (`MIGRATE` or `REPREFILL`). A stream without one ended `DONE`."""

    outcome: Outcome


# What a pass streams: output batches, then at most one `Ended`.
PassItem = list[RequestOutput] | Ended


async def disaggregated(
    prefill_handle, decode: DecodePools, req: PrefillRequest, timing: Timing, resilience: Resilience = Resilience(),
    placement: DisaggregationConfig = _ALWAYS, placed: Callable[[Placement], None] | None = None,
    cluster_view: Callable[[PrefillRequest], Awaitable[ClusterView | None]] | None = None,
    prefill_reachable: Callable[[], bool] | None = None,
) -> AsyncIterator[list[RequestOutput]]:
    """The request's output batches across as many passes as replica losses need: each
    pass continues from every token the client has been sent (`req.session_id` is the
    prefill router's hint, `req.trace` the context both pools continue). The first pass
    decodes on `decode.first`, every later one (and a sequence a draining replica hands
    on) on `decode.elsewhere`. Each pass is placed by `placement`'s rule (priced from
    `cluster_view`, what the routers know, under `auto`), and `placed` is told where.
    A pass bound for the prefill pool while `prefill_reachable()` says it has no live
    replica (every one died, and Serve would queue the call until one is replaced)
    prefills where it decodes instead (`prefill_unavailable`)."""
    view = _ClientView(req.request_id, req.num_prompt_tokens)
    generated: list[int] = []  # every token streamed so far, across passes
    for hop in itertools.count():
        remaining = _remaining(req.sampling, generated)
        if remaining is None:  # the lost replica had produced every token; only the end was lost
            yield [view.final(FinishReason.LENGTH, len(generated))]
            return
        # Each pass is a new request for the pools (a replica may still know the last id).
        # A migrated pass computes its own context: it forks nothing.
        lost = decode.first_lost()
        sub = dataclasses.replace(
            req, request_id=req.request_id if hop == 0 else f"{req.request_id}.m{hop}",
            prompt_token_ids=req.prompt_token_ids + tuple(generated), sampling=remaining,
            fork_of=req.fork_of if hop == 0 else None,
            avoid_replicas=req.avoid_replicas + ((lost,) if lost is not None else ()),
        )
        pools = decode if hop == 0 and lost is None else DecodePools.one(decode.elsewhere)
        one: _Pass | _LocalPass
        if sub.fork_of is not None:  # to the decode replica its sibling runs on, to fork its KV there
            one = _LocalPass(pools, sub, timing, resilience)
        else:
            seen = await _view(cluster_view, sub) if placement.mode == "auto" else None
            decision = choose_placement(sub.num_prompt_tokens, placement, seen)
            if decision.where is Where.REMOTE and prefill_reachable is not None and not prefill_reachable():
                decision = Placement(Where.LOCAL, "prefill_unavailable")
            if placed is not None:
                placed(decision)
            if decision.where is Where.LOCAL:
                one = _LocalPass(pools, sub, timing, resilience)
            else:
                one = _Pass(prefill_handle, pools, sub, timing, resilience, placed, prefill_reachable)
        base = len(generated)
        outcome = Outcome.DONE
        # Closed with us (aclosing), so a client that leaves cancels the decode call and
        # rejects the lease now, not when the abandoned generator is collected.
        async with contextlib.aclosing(one.run()) as items:
            async for item in items:
                if isinstance(item, Ended):
                    outcome = item.outcome
                    continue
                outs = [view.adapt(o, base) for o in item]
                generated.extend(t for o in outs for t in o.new_token_ids)
                yield outs
        if outcome is Outcome.DONE:
            return


async def _view(view: Callable[[PrefillRequest], Awaitable[ClusterView | None]] | None,
                req: PrefillRequest) -> ClusterView | None:
    """What the routers know about `req`'s two places; None (the length rule decides)
    when there is no view or reading it failed: a placement never fails a request."""
    if view is None:
        return None
    try:
        return await view(req)
    except Exception:
        log.warning("request %s: reading the routers' view failed; placing by prompt length", req.request_id,
                    exc_info=True)
        return None


class DecodePool(Protocol):
    """What the pipeline uses of a decode pool: a request's stream of output batches
    (and a `SequenceMoved` last when the replica hands it on), closed to cancel it. The
    decode server of the replica the gateway runs in (decode/server.py), or a handle
    to the decode deployment (`RemotePool`): the other replicas."""

    def generate(self, req: DecodeRequest | PrefillRequest,
                 ) -> AsyncGenerator[list[RequestOutput] | SequenceMoved, None]: ...

    async def stats(self) -> dict[str, Any]: ...


class RemotePool:
    """A pool's deployment behind its handle (and its request router): what
    `DecodePool` asks, as Serve calls. `handle` may be a callable that returns it,
    asked on first use: a decode replica's handle to its own deployment cannot be
    bound when the application is built."""

    def __init__(self, handle):
        self._handle = handle

    @property
    def handle(self):
        if callable(self._handle) and not hasattr(self._handle, "options"):
            self._handle = self._handle()
        return self._handle

    async def generate(self, req: DecodeRequest | PrefillRequest) -> AsyncGenerator[Any, None]:
        """The call's stream, cancelled when it is closed before its end."""
        stream = self.handle.options(stream=True).generate.remote(req)
        try:
            async for item in stream:
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            stream.cancel()
            raise

    async def stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()


@dataclass(frozen=True)
class DecodePools:
    """Where a request decodes: `first`, the pool its first pass goes to (the decode
    server of the replica the gateway runs in); `elsewhere`, the pool for what a lost
    or draining replica leaves (a migrated pass, a moved sequence): the deployment."""

    first: DecodePool
    elsewhere: DecodePool
    # `first`'s replica id while its engine is lost (else None): a pass then starts
    # elsewhere, and the decode router keeps it away from that replica.
    first_lost: Callable[[], str | None] = lambda: None

    @classmethod
    def one(cls, pool: DecodePool) -> DecodePools:
        """Every pass to the same pool (a migrated pass: the deployment)."""
        return cls(pool, pool)


class _Decoding:
    """A pass's decode calls: the first, and one more each time a draining decode
    replica hands the sequence on (`SequenceMoved`: its KV leased there, pulled by
    the next replica, no prefill). Its stream ends with an `Ended` when the last call
    did not finish the request."""

    def __init__(self, pools: DecodePools, req: PrefillRequest, timing: Timing, resilience: Resilience):
        self.pools, self.req, self.timing, self.resilience = pools, req, timing, resilience

    async def follow(self, call: DecodeRequest, first: list[RequestOutput] | None = None,
                     pool: DecodePool | None = None) -> AsyncGenerator[PassItem, None]:
        """`call` decoded to its end on `pool` (the first pool by default), following
        each move to the pool elsewhere; `first` (the prefill's first token) is yielded
        under the first call's lease."""
        pool = pool or self.pools.first
        while True:
            moved: SequenceMoved | None = None
            async with contextlib.aclosing(self._one(pool, call, first)) as items:
                async for item in items:
                    if isinstance(item, SequenceMoved):
                        moved = item
                    else:
                        yield item
            if moved is None:
                return
            first, call, pool = None, moved.request, self.pools.elsewhere
            self.timing.moves += 1
            log.info("request %s: decode replica %s drained; its sequence moved with its KV",
                     self.req.request_id, moved.from_replica)

    async def _one(self, pool: DecodePool, call: DecodeRequest, first: list[RequestOutput] | None,
                   ) -> AsyncGenerator[PassItem | SequenceMoved, None]:
        """One decode call to `pool` under a `LeaseGuard` on its handle: its batches,
        then a `SequenceMoved` if the replica handed the sequence on, or an `Ended` if
        the call failed in a way the request survives. Closing the call's stream (on
        every way out) cancels it."""
        handle = call.kv_handle
        async with LeaseGuard(handle, _REJECT_TIMEOUT_S) as lease:
            finished = False  # the request's final output came through
            moved: SequenceMoved | None = None
            try:
                async with contextlib.aclosing(pool.generate(call)) as batches:
                    grace = self.resilience.decode_start_grace_s
                    # The decode call starts now (its KV pull with it), while the first
                    # token goes to the client, not when the client asks for the next.
                    started = asyncio.ensure_future(
                        _first_batch(batches, max(0.0, handle.lease_expiry - time.time()) + grace))
                    try:
                        if first:
                            yield first
                        item = await started
                    finally:
                        if not started.done():  # the client left with the first token
                            started.cancel()
                            await asyncio.gather(started, return_exceptions=True)
                    while True:
                        if isinstance(item, SequenceMoved):
                            moved = item
                        else:
                            finished = item[-1].finished
                            yield item
                        item = await batches.__anext__()
            except StopAsyncIteration:
                lease.settled()  # decode imported the KV (and released the lease), then streamed to the end
            except UpstreamError:  # no replica started it: the lease is rejected on the way out
                raise
            except Exception as e:
                if finished or moved is not None:  # lost after the end, or after handing the sequence on
                    lease.settled()
                else:
                    yield Ended(self._failed(e, lease, resumed=call.resume is not None))
                    return
        if moved is not None:
            yield moved

    def _failed(self, e: Exception, lease: LeaseGuard, resumed: bool) -> Outcome:
        """What a failed decode call means: migrate (its replica was lost, or a moved
        sequence could not be imported), prefill again (the KV's source is gone), or
        fail the request (raise `UpstreamError`)."""
        req, timing, resilience = self.req, self.timing, self.resilience
        if isinstance(e, _REPLICA_GONE):
            lease.reject_as(RejectReason.DECODE_LOST)
            _count_migration(req, e, timing, resilience)
            return Outcome.MIGRATE
        if isinstance(e, ImportFailed):
            lease.settled()  # decode rejected it (and its replica may be gone)
            if resumed:  # the draining replica's KV did not arrive: recompute it elsewhere
                _count_migration(req, e, timing, resilience)
                return Outcome.MIGRATE
            if e.reason in _SOURCE_LOST and timing.prefill_retries < resilience.prefill_retries:
                timing.prefill_retries += 1
                log.warning("request %s: KV import failed (%s); prefilling again", req.request_id, _short(e))
                return Outcome.REPREFILL
        raise UpstreamError(f"decode failed: {_short(e)}", capacity=_is_capacity(e)) from e


class _Pass:
    """One prefill → decode pass of a request: prefill (retried on another replica if
    its replica is lost), the first token at once, then decode (`_Decoding`: under a
    `LeaseGuard`, following moves). With no prefill replica to answer (each try found
    its replica or its engine gone), the pass prefills where it decodes (`_LocalPass`),
    and `placed` is told so (`prefill_unavailable`). Its stream ends with an `Ended`
    when it did not finish the request; a failure it cannot recover from raises
    `UpstreamError`."""

    def __init__(self, prefill_handle, pools: DecodePools, req: PrefillRequest, timing: Timing,
                 resilience: Resilience, placed: Callable[[Placement], None] | None = None,
                 reachable: Callable[[], bool] | None = None):
        self.prefill, self.req, self.timing, self.resilience = prefill_handle, req, timing, resilience
        self.pools, self.placed, self.reachable = pools, placed, reachable
        self.decoding = _Decoding(pools, req, timing, resilience)

    async def run(self) -> AsyncGenerator[PassItem, None]:
        try:
            result = await _prefill(self.prefill, self.req, self.timing, self.resilience, self.reachable)
        except PrefillUnavailable as e:
            log.warning("request %s: %s; prefilling where it decodes", self.req.request_id, e)
            if self.placed is not None:
                self.placed(Placement(Where.LOCAL, "prefill_unavailable"))
            local = _LocalPass(self.pools, self.req, self.timing, self.resilience)
            async with contextlib.aclosing(local.run()) as items:
                async for item in items:
                    yield item
            return
        handle = result.kv_handle
        if handle is None:  # finished at prefill: no lease was granted
            yield [_first_output(result)]
            return
        req = self.req
        assert result.first_token is not None  # a lease is granted with the first token
        call = DecodeRequest(req.request_id, req.prompt_token_ids, result.first_token, req.sampling, handle,
                             req.trace, req.cache_salt, avoid_replicas=req.avoid_replicas)
        async with contextlib.aclosing(self.decoding.follow(call, [_first_output(result)])) as items:
            async for item in items:
                yield item


class _LocalPass:
    """One pass of a request prefilled where it decodes: the whole request on one decode
    replica (a `PrefillRequest` to its `generate`), no lease and no transfer. A replica
    lost mid-stream migrates the request as `_Pass` does (its stream ends with an
    `Ended`), and one that drains hands it on (`_Decoding`)."""

    def __init__(self, pools: DecodePools, req: PrefillRequest, timing: Timing, resilience: Resilience):
        self.pools, self.req, self.timing, self.resilience = pools, req, timing, resilience
        self.decoding = _Decoding(pools, req, timing, resilience)

    async def run(self) -> AsyncGenerator[PassItem, None]:
        finished = False
        moved: SequenceMoved | None = None
        try:
            async with contextlib.aclosing(self.pools.first.generate(self.req)) as stream:
                async for item in stream:
                    if isinstance(item, SequenceMoved):
                        moved = item
                        continue
                    finished = item[-1].finished
                    yield item
        except Exception as e:
            if finished:
                return
            if moved is None:
                if not isinstance(e, _REPLICA_GONE):
                    raise UpstreamError(f"decode failed: {_short(e)}") from e
                _count_migration(self.req, e, self.timing, self.resilience)
                yield Ended(Outcome.MIGRATE)
                return
        if moved is None:
            return
        self.timing.moves += 1
        # It was handed on by a draining replica: it continues on another one.
        async with contextlib.aclosing(self.decoding.follow(moved.request, pool=self.pools.elsewhere)) as moves:
            async for after_move in moves:
                yield after_move


def _count_migration(req: PrefillRequest, e: Exception, timing: Timing, resilience: Resilience) -> None:
    """A decode replica was lost mid-stream: count one more migration, or fail the
    request (`UpstreamError`) when it has used them all."""
    if timing.migrations >= resilience.max_migrations:
        n = resilience.max_migrations
        limit = f" (migration limit {n} reached)" if n else ""
        raise UpstreamError(f"decode failed{limit}: {_short(e)}") from e
    timing.migrations += 1
    log.warning("request %s: decode replica lost (%s); migrating (%d of %d)",
                req.request_id, _short(e), timing.migrations, resilience.max_migrations)


async def _first_batch(batches: AsyncIterator, timeout_s: float):
    """The decode stream's first batch, or a 503 if no replica started the call within
    `timeout_s` (Serve queues a call while the pool has no live replica)."""
    try:
        return await asyncio.wait_for(batches.__anext__(), timeout_s)
    except TimeoutError:
        raise UpstreamError(f"no decode replica started the request within {timeout_s:.0f} s "
                            "(its KV lease has ended; is the decode pool down?)", capacity=True) from None


async def _prefill(handle, req: PrefillRequest, timing: Timing, resilience: Resilience,
                   reachable: Callable[[], bool] | None = None) -> PrefillResult:
    """The prefill call, tried on another replica when the one it reached is gone. A
    call is given up, and the pass prefills locally (`PrefillUnavailable`), when the
    prefill pool has no live replica left while it waits (`reachable()` turns False:
    Serve would queue it until one is replaced, 10-20 s), or when a retry is not
    answered within `prefill_retry_wait_s`."""
    for attempt in itertools.count():
        response = handle.prefill.remote(req)
        try:
            return await _answer(response, reachable, None if attempt == 0 else resilience.prefill_retry_wait_s)
        except asyncio.CancelledError:
            # A cancelled await leaves the Serve call running: the prefill replica would
            # finish the prompt and lease its KV to nobody (held until the lease's TTL).
            # Cancelled, the replica stops the prefill, or withdraws a lease it granted.
            response.cancel()
            raise
        except _REPLICA_GONE as e:
            if attempt >= resilience.prefill_retries:
                raise PrefillUnavailable(f"prefill failed: {_short(e)}") from e
            timing.prefill_retries += 1
            log.warning("request %s: prefill replica lost (%s); trying another", req.request_id, _short(e))
        except PrefillUnavailable:
            raise
        except Exception as e:
            raise UpstreamError(f"prefill failed: {_short(e)}") from e
    raise AssertionError("unreachable")


# How often a waiting prefill call looks whether its pool still has a live replica.
_REACHABLE_POLL_S = 0.2


async def _answer(response, reachable: Callable[[], bool] | None, wait_s: float | None):
    """`await response`, given up (the call cancelled: the replica that takes it stops
    it, or withdraws its lease) when `reachable()` turns False or after `wait_s`."""
    call = asyncio.ensure_future(_awaited(response))
    started = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=_REACHABLE_POLL_S)
            if done:
                return call.result()
            if reachable is not None and not reachable():
                raise PrefillUnavailable("the prefill pool has no live replica")
            if wait_s is not None and time.monotonic() - started > wait_s:
                raise PrefillUnavailable(f"no prefill replica answered the retry within {wait_s:g} s")
    finally:
        if not call.done():
            call.cancel()
            response.cancel()


async def _awaited(response):
    return await response


def choices(run: Callable[[PrefillRequest], AsyncGenerator[list[RequestOutput], None]],
            reqs: list[PrefillRequest], fork_after_tokens: int) -> AsyncGenerator[list[RequestOutput], None]:
    """The `n` choices of one request (`run` is one choice's pipeline), merged. The first
    runs at once. The others wait until it has produced `fork_after_tokens` tokens, so
    its prompt's KV sits where it decodes (P/D: prefill's token and decode's first; one
    pool: its first), and go there to fork that KV (`fork_of`): one prefill, one import,
    the prompt's blocks shared. If the first ends sooner, or fails, they run as it did."""
    first, rest = reqs[0], reqs[1:]
    produced = 0
    ended = False
    ready = asyncio.Event()

    async def leader() -> AsyncGenerator[list[RequestOutput], None]:
        nonlocal produced, ended
        try:
            async with contextlib.aclosing(run(first)) as batches:
                async for outs in batches:
                    produced += sum(len(o.new_token_ids) for o in outs)
                    ended = outs[-1].finished
                    if produced >= fork_after_tokens or ended:
                        ready.set()
                    yield outs
        finally:
            ended = True
            ready.set()

    async def follower(req: PrefillRequest) -> AsyncGenerator[list[RequestOutput], None]:
        await ready.wait()
        if not ended:
            req = dataclasses.replace(req, fork_of=first.request_id)
        async with contextlib.aclosing(run(req)) as batches:
            async for outs in batches:
                yield outs

    return merged([leader(), *(follower(r) for r in rest)])


async def merged(streams: list[AsyncGenerator]) -> AsyncGenerator:
    """The batches of several pipelines (a request's `n` choices) as they arrive. The
    first error ends them all; leaving early closes every one (calls cancelled, leases
    rejected)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncGenerator) -> None:
        _own_serve_request_id()  # this task's context is its own copy: only its calls see it
        try:
            async with contextlib.aclosing(stream) as batches:
                async for outs in batches:
                    await queue.put(outs)
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _own_serve_request_id() -> None:
    """Give the handle calls made from here on a Serve internal request id of their own.

    A handle call inherits the internal request id of the request being served, and
    Serve's router matches a queued call to its chosen replica by that id: two calls in
    flight at once from one request (its `n` choices) would share it, and the router
    spins on the mismatch (seen as a request that never starts, at 100% CPU). Private
    Serve API (ray.serve.context), the only way to set it."""
    _set_request_context(_internal_request_id=generate_request_id())


async def within(batches: AsyncGenerator, timeout_s: float | None) -> AsyncGenerator:
    """`batches` until `timeout_s` has passed since the first was asked for; then the
    pipeline is cancelled (its Serve calls cancelled, its lease rejected) and a 504 raised."""
    if timeout_s is None:
        async for outs in batches:
            yield outs
        return
    deadline = time.monotonic() + timeout_s
    step: asyncio.Future | None = None  # the batch being waited for
    try:
        while True:
            step = asyncio.ensure_future(batches.__anext__())
            done, _ = await asyncio.wait({step}, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise deadline_exceeded(timeout_s)
            try:
                outs = step.result()
            except StopAsyncIteration:
                return
            yield outs
    finally:
        if step is not None and not step.done():
            # Cancelled (or out of time) mid-batch: the cancellation unwinds and closes the
            # pipeline inside `step`; closing it from here too would find it still running.
            step.cancel()
            await asyncio.wait({step})
        else:
            await batches.aclose()


def _first_output(result: PrefillResult) -> RequestOutput:
    return RequestOutput(
        request_id=result.request_id,
        new_token_ids=[] if result.first_token is None else [result.first_token],
        text=result.text,
        finished=result.finish_reason is not None,
        finish_reason=result.finish_reason,
        num_prompt_tokens=result.num_prompt_tokens,
        num_cached_tokens=result.num_cached_tokens,
        num_output_tokens=0 if result.first_token is None else 1,
        logprobs=[result.first_token_logprobs] if result.first_token_logprobs else None,
    )


@dataclass
class _ClientView:
    """Outputs as the client must see them whatever migrations happened: its request
    id, its prompt length, output counts that include the tokens before a migration,
    and the prompt's cached tokens as first measured."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int | None = None

    def adapt(self, out: RequestOutput, tokens_before: int) -> RequestOutput:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens
        if tokens_before == 0 and out.request_id == self.request_id:
            return out
        return dataclasses.replace(
            out,
            request_id=self.request_id,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=out.num_output_tokens + tokens_before,
        )

    def final(self, reason: FinishReason, num_output_tokens: int) -> RequestOutput:
        return RequestOutput(self.request_id, [], "", True, reason, self.num_prompt_tokens,
                             self.num_cached_tokens or 0, num_output_tokens)


def _remaining(sp: SamplingParams, generated: list[int]) -> SamplingParams | None:
    """The sampling of the rest of a request after `generated`; None if nothing is left.
    A grammar resumes where those tokens left it."""
    done = len(generated)
    if done == 0:
        return sp
    if done >= sp.max_tokens:
        return None
    structured = sp.structured
    if structured is not None:
        structured = dataclasses.replace(structured, prefix=structured.prefix + tuple(generated))
    return dataclasses.replace(sp, max_tokens=sp.max_tokens - done, structured=structured)


class AggregatedPool(Protocol):
    """What the gateway uses of the aggregated pool: the aggregated server of the
    replica it runs in (decode/aggregated.py)."""

    def generate(self, req: PrefillRequest) -> AsyncGenerator[list[RequestOutput], None]: ...

    async def stats(self) -> dict[str, Any]: ...


async def aggregated(pool: AggregatedPool, req: PrefillRequest) -> AsyncIterator[list[RequestOutput]]:
    """The request's output batches from one aggregated replica."""
    async with contextlib.aclosing(pool.generate(req)) as stream:
        try:
            async for outs in stream:
                yield outs
        except Exception as e:
            raise UpstreamError(f"engine failed: {_short(e)}") from e


def _is_capacity(e: BaseException) -> bool:
    # Ray re-raises the replica's exception as a subclass of its type.
    return isinstance(e, ImportFailed) and e.reason == RejectReason.NO_FREE_BLOCKS


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:500]
