"""`AsyncEngine`: drives one `Engine` from a dedicated thread for asyncio callers.

Every mutation (add, abort, import, release) is a command executed on the engine
thread between steps, so the engine itself needs no locks. Outputs go to one
asyncio queue per request; a consumer drains everything that is ready at once, so
tokens produced while it was busy travel together (one streamed item, not many).

`stream_interval` (the engine config's) makes that a floor: after the first item,
each item waits for that many outputs (or the end). Every streamed item costs CPU
in the replica, the gateway, Serve's proxy and the client, and on a small machine
those cores are the engine's (docs/benchmarks.md, serving efficiency).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import torch

from engine.config import EngineConfig, Role
from engine.core_share import team_size
from engine.engine import Engine, MovedSequence
from engine.external_kv import ExternalKVSpec, ManagedExternalKV
from engine.kv_events import KVEvent
from engine.replica_engine import pool_holds
from engine.request import EngineDead, RequestFailed, RequestOutput, ResumeState
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.step_trace import StepTrace
from engine.structured import GrammarMatcher

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """Owns the engine thread, the command queue and the per-request output queues."""

    def __init__(self, engine: Engine, kv_events: bool = False):
        """`kv_events`: keep the block pool's KV events for `take_kv_events` (a replica
        that publishes them); otherwise they are dropped each step, not hoarded."""
        self.engine = engine
        self.kv_events = kv_events
        self.stream_interval = engine.cfg.stream_interval
        self.block_size = engine.cfg.block_size
        self.num_kv_blocks = engine.block_pool.num_blocks
        self.model_id = engine.model_id
        self.model_fingerprint = engine.model_fingerprint
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._streams: Streams = {}
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        self.stats: EngineStats = engine.stats()
        self.external_kv: ManagedExternalKV | None = None  # built by `start_engine`; closed by `shutdown`
        self._trace = StepTrace.from_env(engine.role)
        self._thread = threading.Thread(target=self._loop, name="duet-engine", daemon=True)
        self._thread.start()

    @property
    def kv_data(self) -> torch.Tensor:
        """The engine's KV tensor, for the replica's transfer backend to register."""
        return self.engine.kv_cache.data

    @property
    def external_kv_stats(self) -> dict[str, Any]:
        """The external KV cache's counters (`ManagedExternalKV.as_dict`); {} without one."""
        return self.external_kv.as_dict() if self.external_kv is not None else {}

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                began = time.monotonic()
                outputs = self.engine.step()
                if self._trace is not None:
                    self._trace.record(began, time.monotonic() - began, torch.get_num_threads(), len(outputs))
                self._publish(outputs)
        except BaseException as e:  # the engine is broken: fail every stream loudly
            log.exception("engine loop died")
            self._error = e
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, e)

    def _run_commands(self) -> None:
        ran = False
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                if ran:  # a command may change the pool with no step after it (a lease's release)
                    self.stats = self.engine.stats()
                return
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        hand_off(route(outputs, self._streams))
        events = self.engine.take_kv_events()
        if events and self.kv_events:
            with self._events_lock:
                self._events.extend(events)
        self.stats = self.engine.stats()

    # ------------------------------------------------------------ commands
    def check_health(self) -> None:
        """Raise if the engine thread died (Serve's health check restarts the replica)."""
        if self._error is not None:
            raise EngineDead(str(self._error))

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between steps; callable from any thread."""
        self.check_health()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    # ------------------------------------------------------------ typed commands
    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Start a request from its prompt; its stream of output batches. `fork_of`: a
        choice of the same request whose prompt KV it may fork (`Engine.add_request`)."""
        eng = self.engine
        grammar = await self._grammar(sampling, [])
        return await self.add(request_id, lambda: eng.add_request(prompt_token_ids, sampling, request_id=request_id,
                                                                  grammar=grammar, cache_salt=cache_salt,
                                                                  fork_of=fork_of))

    async def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
        take_blocks: Callable[[], list[int] | None],
        cache_salt: str | None = None,
        resume: ResumeState | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Start a request whose prompt KV was imported: `take_blocks` hands over the
        blocks holding it (None: recompute the prompt here), on the engine thread and
        only if the request really starts. If the engine refuses the request, the
        blocks are freed here; if the command never runs (cancelled first), the
        caller still owns them. `resume`: a sequence another engine moved out."""
        eng = self.engine
        num_output = 1 if resume is None else resume.num_output_tokens
        grammar = await self._grammar(sampling, [*prompt_token_ids, first_token][-num_output:])

        def start() -> None:
            blocks = take_blocks()
            try:
                eng.add_imported_request(request_id, prompt_token_ids, first_token, sampling, blocks, grammar=grammar,
                                         cache_salt=cache_salt, resume=resume)
            except Exception:
                if blocks is not None:
                    eng.release_blocks(blocks)
                raise

        return await self.add(request_id, start)

    async def move_out(self, request_ids: list[str], on_moved: Callable[[MovedSequence], None]) -> list[str]:
        """Take these requests' decoding sequences out of the engine, in one command
        between steps (`Engine.move_out`); `on_moved` gets each on the engine thread
        (where its blocks must be leased, before its stream ends). Returns the ids
        moved; the others (not decoding now) stay."""
        eng = self.engine

        def move() -> list[str]:
            moved = []
            for request_id in request_ids:
                seq = eng.move_out(request_id)
                if seq is None:
                    continue
                try:
                    on_moved(seq)
                except Exception:
                    eng.release_blocks(seq.block_ids)
                    raise
                moved.append(request_id)
            return moved

        return await self.call(move)

    async def _grammar(self, sampling: SamplingParams, output_ids: list[int]) -> GrammarMatcher | None:
        """A structured request's matcher, compiled on a worker thread: a large schema
        takes milliseconds to more, and the step loop must not wait for it (llguidance
        drops the GIL while it builds)."""
        if sampling.structured is None:
            return None
        return await asyncio.to_thread(self.engine.grammars.matcher, sampling.structured, output_ids)

    async def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        """Free blocks for `num_tokens` of imported KV, or None while the pool (or the
        running batch) is full."""
        eng = self.engine
        return await self.call(lambda: eng.reserve_import(num_tokens))

    def could_ever_hold(self, num_tokens: int) -> bool:
        """Whether the whole pool, empty, holds `num_tokens` (the pool's size never changes)."""
        return pool_holds(num_tokens, self.block_size, self.num_kv_blocks)

    def release_blocks(self, block_ids: list[int]) -> concurrent.futures.Future:
        """Free blocks nobody will use (a lease that ended, an import that did not
        start); from any thread, without waiting."""
        eng = self.engine
        ids = list(block_ids)
        return self.submit(lambda: eng.release_blocks(ids))

    async def add(self, request_id: str, start: Callable[[], Any]) -> AsyncGenerator[list[RequestOutput], None]:
        """Register a stream for `request_id`, run `start` (which adds the request) on
        the engine thread, then yield batches of outputs until it finishes. Cancelling
        the iterator aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def start_and_register():
            result = start()
            self._streams[request_id] = (loop, q)
            return result

        try:
            await self.call(start_and_register)
        except asyncio.CancelledError:
            # Cancelled while the command waited: the engine thread skips a cancelled
            # command (then `start` never ran, and what the caller prepared for it is
            # still the caller's), or it had run (then the request is in the engine
            # with nobody to read it: abort it rather than let it run to the end).
            self.submit(lambda: self._abort_now(request_id))
            raise
        return self._drain(request_id, q)

    def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncGenerator[list[RequestOutput], None]:
        return drain(request_id, q, self.stream_interval, self.abort)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:  # on the engine thread
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def take_kv_events(self) -> list[KVEvent]:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        if self.external_kv is not None:
            self.external_kv.close()


async def drain(request_id: str, q: asyncio.Queue, stream_interval: int,
                abort: Callable[[str], Awaitable[None]]) -> AsyncGenerator[list[RequestOutput], None]:
    """One request's stream: each item is every output (or engine error) that was
    ready in `q`, at least `stream_interval` of them after the first; `abort`s the
    request if the consumer leaves before it finished."""
    finished = False
    first = True
    try:
        while not finished:
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            if not first:  # the first item (the first token: TTFT) never waits
                while len(batch) < stream_interval and not _ends_stream(batch[-1]):
                    batch.append(await q.get())
            first = False
            for item in batch:
                if isinstance(item, BaseException):
                    raise EngineDead(str(item))
                if item.error is not None:
                    finished = True  # the engine has already freed it
                    raise RequestFailed(f"request {request_id} failed: {item.error}")
            outs: list[RequestOutput] = batch  # type: ignore[assignment]
            finished = outs[-1].finished
            yield outs
    finally:
        if not finished:
            await abort(request_id)


Streams = dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]]
Deliveries = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]]


def route(outputs: list[RequestOutput], streams: Streams) -> Deliveries:
    """One step's outputs grouped by their consumers' event loops; a finished
    request's stream leaves `streams`. Outputs nobody reads (aborted) are dropped."""
    deliveries: Deliveries = {}
    for out in outputs:
        target = streams.get(out.request_id)
        if target is not None:
            deliveries.setdefault(target[0], []).append((target[1], out))
        if out.finished:
            streams.pop(out.request_id, None)
    return deliveries


def hand_off(deliveries: Deliveries) -> None:
    """One hand-off per event loop per step, not one per output: each
    call_soon_threadsafe wakes the loop through its self-pipe."""
    for loop, items in deliveries.items():
        loop.call_soon_threadsafe(deliver, items)


def deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _ends_stream(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, BaseException) or item.error is not None or item.finished


def start_engine(cfg: EngineConfig, role: Role, threads: int | None, kv_events: bool = False,
                 external_kv: ExternalKVSpec | None = None) -> AsyncEngine:
    """A replica's engine on its own thread, warmed up: /ready means one request ran.
    `kv_events`: the replica publishes its KV events (`AsyncEngine.take_kv_events`);
    `external_kv`: the external KV cache to build and attach after the warm-up."""
    # Ray starts actors with OMP_NUM_THREADS=1; the pool's setting decides instead.
    threads = team_size(threads)
    torch.set_num_threads(threads)
    if cfg.share_cores and threads > 1:
        log.info("engine.share_cores: a %s engine on a thread keeps its %d threads (only engine core "
                    "processes share cores)", role, threads)
    # Built on a thread that ends once it is built: in a process where another live
    # thread has run parallel torch ops (loading and packing the weights does), every
    # step on the engine thread took ~24 ms against ~17 (scripts/experiments/
    # engine_placement.py, docs/benchmarks.md). The replica's event loop stays clear of them.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="duet-engine-build") as builder:
        engine = builder.submit(Engine, cfg, role=role).result()
    aengine = AsyncEngine(engine, kv_events)
    aengine.submit(lambda: warm_up(engine)).result()
    if external_kv is not None:
        aengine.external_kv = aengine.submit(lambda: attach_external_kv(engine, external_kv)).result()
    return aengine


def attach_external_kv(engine: Engine, spec: ExternalKVSpec) -> ManagedExternalKV:
    """Build the external KV cache around the engine's KV tensor and attach it (between
    steps, on the engine's thread)."""
    cache = spec.build(engine.kv_cache.data, engine.model_fingerprint)
    try:
        engine.attach_external_kv(cache)
    except BaseException:
        cache.close()
        raise
    return cache


def warm_up(engine: Engine) -> None:
    """One tiny request through the whole step path, then an empty prefix cache."""
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0), request_id="warmup")
    while engine.has_unfinished():
        engine.step()
    export = engine.take_export(rid)
    if export is not None:
        engine.release_blocks(export.block_ids)
    engine.block_pool.reset_prefix_cache()
