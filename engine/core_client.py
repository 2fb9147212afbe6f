"""`EngineCoreClient`: a replica's handle on its engine core process (engine/core_process.py).

It offers what the replicas use of `AsyncEngine` (requests as streams of output
batches, aborts, imported requests and the blocks they reserve, moving sequences out,
the stats snapshot, KV events, health, shutdown; a prefill engine's exports, handed to
`on_export`), so a replica does not know which one it holds. One reader thread
receives the child's messages; each step's outputs reach their requests' asyncio
queues in one hand-off per event loop, and a consumer drains what is ready at once
(`async_engine.drain`). One writer thread sends the commands, in the order they were
given.

Prefill and decode replicas register their KV tensor with their transfer backend
(NIXL, gloo) in their own process: the child allocates that tensor in shared memory
and the client maps it (`kv_data`), so a pull lands in (or reads from) the pages the
engine uses. CPU only: a CUDA KV tensor is not shared this way (`engine_in_child`). A
prefill replica's LMCache tier is built in the child too (`external_kv`), next to the
engine whose step reads and writes it; its counters come with every step message
(`external_kv_stats`), and the child closes it as it stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.async_engine import EngineDead, Streams, drain, hand_off, route
from engine.config import ConfigError, EngineConfig, Role, resolve_device
from engine.core_messages import (
    Abort,
    Add,
    AddImported,
    Call,
    Command,
    Died,
    EngineInfo,
    Init,
    MoveOut,
    Ready,
    Release,
    Reply,
    Reserve,
    Step,
    Stop,
    ToChild,
)
from engine.core_share import team_size
from engine.engine import ExportedKV, MovedSequence
from engine.external_kv import ExternalKVSpec
from engine.kv_events import KVEvent
from engine.replica_engine import pool_holds
from engine.request import RequestOutput, ResumeState
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # loading and warming a large checkpoint on a slow disk
STOP_TIMEOUT_S = 5.0
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
SHARED_KV_ROLES: tuple[Role, ...] = ("prefill", "decode")  # their replica registers the KV tensor

# What the reader thread does with a call's reply before its caller sees it.
OnReply = Callable[[Any], Any]


class EngineCoreClient:
    """Starts the engine core child, waits until it is warm, and talks to it."""

    def __init__(self, cfg: EngineConfig, role: Role, threads: int | None, kv_events: bool = False,
                 on_export: Callable[[ExportedKV], None] | None = None, external_kv: ExternalKVSpec | None = None,
                 on_lost: Callable[[BaseException], None] | None = None):
        """`on_export` (prefill): leases a finished request's pinned blocks, on the
        reader thread, before that step's outputs reach their streams. `external_kv`:
        the external KV cache the child builds and attaches after its warm-up.
        `on_lost`: told on the reader thread, once, when the child dies after it was
        ready (not when `shutdown` stops it), after every call and stream has failed."""
        if role == "prefill" and on_export is None:
            raise ValueError("a prefill engine core needs on_export: its exports would never be leased")
        self._on_export = on_export
        self._on_lost = on_lost
        threads = team_size(threads)
        ours, theirs = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env["PYTHONPATH"] = os.pathsep.join([_PROJECT_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.core_process", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        # Commands go out through one writer thread, in order: a large prompt can fill
        # the socket's buffer until the child reads it between steps, and the replica's
        # event loop must not wait for that.
        self._outbox: queue.SimpleQueue[ToChild | None] = queue.SimpleQueue()
        self._calls: dict[int, tuple[concurrent.futures.Future, OnReply | None]] = {}
        self._call_ids = itertools.count()
        self._streams: Streams = {}
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()  # guards _calls, _streams and _events
        self._error: BaseException | None = None
        self._stopping = False
        # The child closes its external cache as it stops: wait for that too.
        self._stop_timeout_s = STOP_TIMEOUT_S + (external_kv.close_timeout_s if external_kv is not None else 0.0)
        try:
            # Prefill and decode move the engine's KV from this process: share it.
            self._conn.send(Init(cfg.model_dump(), role, threads, kv_events, role in SHARED_KV_ROLES, external_kv))
            info, stats, external_stats = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.info: EngineInfo = info
        self.stats: EngineStats = stats
        # The external KV cache's counters as of the last step ({} without one).
        self.external_kv_stats: dict[str, Any] = external_stats or {}
        self.model_id = info.model_id
        self.model_fingerprint = info.model_fingerprint
        self.block_size = info.block_size
        self.num_kv_blocks = info.num_kv_blocks
        self.stream_interval = info.stream_interval
        # The engine's KV tensor mapped here (prefill, decode), for the transfer backend:
        # its memfd follows "ready" on the socket (read before the reader thread starts).
        self._kv_data = info.shared_kv.receive(self._conn.fileno()) if info.shared_kv is not None else None
        self._reader = threading.Thread(target=self._read, name="duet-engine-core-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="duet-engine-core-writer", daemon=True)
        self._writer.start()

    def _wait_ready(self) -> tuple[EngineInfo, EngineStats, dict[str, Any] | None]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._conn.poll(1.0):
            if self.proc.poll() is not None:
                raise EngineDead(f"engine core exited with {self.proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise EngineDead(f"engine core not ready after {START_TIMEOUT_S:.0f} s")
        msg = self._conn.recv()
        if not isinstance(msg, Ready):
            raise EngineDead(f"engine core failed to start: {msg.message if isinstance(msg, Died) else msg!r}")
        return msg.info, msg.stats, msg.external_kv_stats

    @property
    def kv_data(self) -> torch.Tensor:
        """The engine's KV tensor mapped into this process (prefill and decode engines)."""
        if self._kv_data is None:
            raise RuntimeError("this engine core does not share its KV tensor")
        return self._kv_data

    # ------------------------------------------------------------ reader thread
    def _read(self) -> None:
        try:
            while True:
                match self._conn.recv():
                    case Step() as step:
                        self._on_step(step)
                    case Reply(call_id, ok, value):
                        self._on_reply(call_id, ok, value)
                    case Died(message):
                        raise EngineDead(message)
        except BaseException as e:
            if isinstance(e, (EOFError, OSError)):
                e = EngineDead(f"engine core exited ({self.proc.poll()})")
            self._fail_all(e)

    def _on_reply(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            fut, on_reply = self._calls.pop(call_id, (None, None))
        if fut is None:
            return
        if ok and on_reply is not None:
            # Here, before the reader takes the next message (the step after this reply),
            # and even if the caller has stopped waiting.
            try:
                value = on_reply(value)
            except Exception as e:
                ok, value = False, e
        # A caller cancelled while it waited has cancelled this future too.
        if fut.set_running_or_notify_cancel():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except OSError:  # the child is gone: the reader sees it and fails everything
                return

    def _on_step(self, step: Step) -> None:
        for export in step.exports:  # before the outputs: a finished prefill's caller reads its lease
            self._lease(export)
        with self._lock:
            deliveries = route(step.outputs, self._streams)
            if step.kv_events:
                self._events.extend(step.kv_events)
        self.stats = step.stats
        if step.external_kv_stats is not None:
            self.external_kv_stats = step.external_kv_stats
        hand_off(deliveries)

    def _lease(self, export: ExportedKV) -> None:
        try:
            if self._on_export is None:  # only prefill exports, and it always has one
                raise RuntimeError("no on_export")
            self._on_export(export)
        except Exception:
            log.exception("leasing the KV of %s failed: its blocks are freed", export.request_id)
            self.release_blocks(export.block_ids)

    def _fail_all(self, e: BaseException) -> None:
        if not self._stopping:
            log.error("engine core lost: %s", e)
        with self._lock:
            self._error = e
            calls, self._calls = self._calls, {}
            streams, self._streams = self._streams, {}
        for fut, _ in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(e)
        for loop, q in streams.values():
            loop.call_soon_threadsafe(q.put_nowait, e)
        if self._on_lost is not None and not self._stopping:
            try:
                self._on_lost(e)
            except Exception:
                log.exception("on_lost failed")

    # ------------------------------------------------------------ commands
    def check_health(self) -> None:
        """Raise if the child died or hung up (the replica then starts a new one:
        engine/core_restarts.py)."""
        if self._error is not None:
            raise EngineDead(str(self._error))
        if self.proc.poll() is not None:
            raise EngineDead(f"engine core exited with {self.proc.returncode}")

    def _send(self, msg: ToChild) -> None:
        self._outbox.put(msg)

    def _submit(self, command: Command, on_reply: OnReply | None = None) -> concurrent.futures.Future:
        """Send a command; its reply resolves the future. From any thread."""
        self.check_health()
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:  # lost between the health check and here
                raise EngineDead(str(self._error))
            self._calls[call_id] = (fut, on_reply)
        self._send(Call(call_id, command))
        return fut

    async def _call(self, command: Command, on_reply: OnReply | None = None) -> Any:
        return await asyncio.wrap_future(self._submit(command, on_reply=on_reply))

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Start a request from its prompt; its stream of output batches (as
        `AsyncEngine.add_request`). The stream is registered before the child hears of
        the request, so no output can arrive unclaimed."""
        prompt = list(prompt_token_ids)
        return await self._start(request_id, lambda: Add(request_id, prompt, sampling, cache_salt, fork_of))

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
        """Start a request whose prompt KV was imported into `kv_data` (as
        `AsyncEngine.add_imported_request`). The blocks are taken as the command is
        sent, so from then on they are the child's: it frees them if the request
        never starts, and an abort frees them after."""
        prompt = list(prompt_token_ids)
        return await self._start(request_id, lambda: AddImported(request_id, prompt, first_token, sampling,
                                                                 take_blocks(), cache_salt, resume))

    async def _start(self, request_id: str, command: Callable[[], Command],
                     ) -> AsyncGenerator[list[RequestOutput], None]:
        """Register the request's stream, then send the command that starts it (built
        only now, so blocks it takes go out at once): no output can arrive unclaimed."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (loop, q)
        try:
            self.check_health()
            await self._call(command())
        except asyncio.CancelledError:
            await asyncio.shield(self.abort(request_id))  # it may have started: nobody reads it
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        return drain(request_id, q, self.stream_interval, self.abort)

    async def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        """Free blocks for `num_tokens` of imported KV, or None while the pool (or the
        running batch) is full."""
        return await self._call(Reserve(num_tokens))

    def could_ever_hold(self, num_tokens: int) -> bool:
        """Whether the whole pool, empty, holds `num_tokens` (the pool's size never changes)."""
        return pool_holds(num_tokens, self.block_size, self.num_kv_blocks)

    def release_blocks(self, block_ids: list[int]) -> concurrent.futures.Future:
        """Free blocks nobody will use; from any thread, without waiting. A dead
        engine's blocks went with it: nothing to free (a lease that ends after the
        engine died, an import discarded then)."""
        try:
            return self._submit(Release(list(block_ids)))
        except EngineDead:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done

    async def move_out(self, request_ids: list[str], on_moved: Callable[[MovedSequence], None]) -> list[str]:
        """Take these requests' decoding sequences out of the engine (as
        `AsyncEngine.move_out`). `on_moved` gets each on the reader thread, before the
        step that ends its stream is delivered; one that raises has its blocks freed."""

        def lease(moved: list[MovedSequence]) -> list[str]:
            ids = []
            for seq in moved:
                try:
                    on_moved(seq)
                except Exception:
                    log.exception("moving %s out: its blocks could not be leased", seq.request_id)
                    self.release_blocks(seq.block_ids)
                    continue
                ids.append(seq.request_id)
            return ids

        return await self._call(MoveOut(list(request_ids)), on_reply=lease)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if self._error is None:
            await self._call(Abort(request_id))

    def take_kv_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        """Ask the child to stop, then make sure it is gone."""
        if self._stopping:
            return
        self._stopping = True
        self._send(Stop())
        self._outbox.put(None)
        try:
            self.proc.wait(self._stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
        self._conn.close()

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def engine_in_child(setting: bool | None, cfg: EngineConfig, pool: str) -> bool:
    """Whether a prefill or decode replica runs its engine in a child process: the
    pool's `engine_process` (`setting`), None meaning yes on a CPU. Their KV tensor is
    shared with the replica through CPU memory, so an engine on a GPU stays on a thread."""
    on_cpu = resolve_device(cfg.device) == "cpu"
    if setting and not on_cpu:
        raise ConfigError(f"{pool}.engine_process", "a prefill or decode engine runs in its own process on a CPU only")
    return on_cpu if setting is None else setting
