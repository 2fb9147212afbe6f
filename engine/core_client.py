"""`EngineCoreClient`: a replica's handle on its engine core process (engine/core_process.py).

It offers what the aggregated replica uses of `AsyncEngine` (requests as streams of
output batches, aborts, the stats snapshot, KV events, health, shutdown), so the
replica does not know which one it holds. One reader thread receives the child's
messages; each step's outputs reach their requests' asyncio queues in one hand-off
per event loop, and a consumer drains what is ready at once (`async_engine.drain`).
One writer thread sends the commands, in the order they were given.

Only the aggregated role runs this way today: prefill and decode register their KV
tensor with NIXL and LMCache in the replica's process, and that registration would
have to move into the child with the engine.
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
from collections.abc import AsyncGenerator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.async_engine import EngineDead, Streams, drain, hand_off, route
from engine.config import EngineConfig, Role
from engine.core_process import EngineInfo
from engine.kv_events import KVEvent
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # loading and warming a large checkpoint on a slow disk
STOP_TIMEOUT_S = 5.0
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


class EngineCoreClient:
    """Starts the engine core child, waits until it is warm, and talks to it."""

    def __init__(self, cfg: EngineConfig, role: Role, threads: int, kv_events: bool = False):
        if role != "aggregated":
            raise ValueError("only the aggregated role runs its engine in its own process")
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
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._streams: Streams = {}
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()  # guards _calls, _streams and _events
        self._error: BaseException | None = None
        self._stopping = False
        try:
            self._conn.send(("init", cfg.model_dump(), role, threads, kv_events))
            info, stats = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.info: EngineInfo = info
        self.stats: EngineStats = stats
        self.model_id = info.model_id
        self.model_fingerprint = info.model_fingerprint
        self.block_size = info.block_size
        self.num_kv_blocks = info.num_kv_blocks
        self.stream_interval = info.stream_interval
        self._reader = threading.Thread(target=self._read, name="duet-engine-core-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="duet-engine-core-writer", daemon=True)
        self._writer.start()

    def _wait_ready(self) -> tuple[EngineInfo, EngineStats]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._conn.poll(1.0):
            if self.proc.poll() is not None:
                raise EngineDead(f"engine core exited with {self.proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise EngineDead(f"engine core not ready after {START_TIMEOUT_S:.0f} s")
        msg = self._conn.recv()
        if msg[0] != "ready":
            raise EngineDead(f"engine core failed to start: {msg[1]}")
        return msg[1], msg[2]

    # ------------------------------------------------------------ reader thread
    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "step":
                    self._on_step(msg[1], msg[2], msg[3])
                elif msg[0] == "reply":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    # A caller cancelled while it waited has cancelled this future too.
                    if fut is not None and fut.set_running_or_notify_cancel():
                        if msg[2]:
                            fut.set_result(msg[3])
                        else:
                            fut.set_exception(msg[3])
                elif msg[0] == "died":
                    raise EngineDead(msg[1])
        except BaseException as e:
            if isinstance(e, (EOFError, OSError)):
                e = EngineDead(f"engine core exited ({self.proc.poll()})")
            self._fail_all(e)

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except OSError:  # the child is gone: the reader sees it and fails everything
                return

    def _on_step(self, outputs: list[RequestOutput], stats: EngineStats, events: list[KVEvent]) -> None:
        with self._lock:
            deliveries = route(outputs, self._streams)
            if events:
                self._events.extend(events)
        self.stats = stats
        hand_off(deliveries)

    def _fail_all(self, e: BaseException) -> None:
        if not self._stopping:
            log.error("engine core lost: %s", e)
        with self._lock:
            self._error = e
            calls, self._calls = self._calls, {}
            streams, self._streams = self._streams, {}
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(e)
        for loop, q in streams.values():
            loop.call_soon_threadsafe(q.put_nowait, e)

    # ------------------------------------------------------------ commands
    def check_health(self) -> None:
        """Raise if the child died or hung up (Serve's health check restarts the replica)."""
        if self._error is not None:
            raise EngineDead(str(self._error))
        if self.proc.poll() is not None:
            raise EngineDead(f"engine core exited with {self.proc.returncode}")

    def _send(self, msg: tuple) -> None:
        self._outbox.put(msg)

    async def _call(self, *msg: Any) -> Any:
        self.check_health()
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:  # lost between the health check and here
                raise EngineDead(str(self._error))
            self._calls[call_id] = fut
        self._send((msg[0], call_id, *msg[1:]))
        return await asyncio.wrap_future(fut)

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Start a request from its prompt; its stream of output batches (as
        `AsyncEngine.add_request`). The stream is registered before the child hears of
        the request, so no output can arrive unclaimed."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (loop, q)
        try:
            await self._call("add", request_id, list(prompt_token_ids), sampling, cache_salt, fork_of)
        except asyncio.CancelledError:
            await asyncio.shield(self.abort(request_id))  # it may have started: nobody reads it
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        return drain(request_id, q, self.stream_interval, self.abort)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if self._error is None:
            await self._call("abort", request_id)

    def take_kv_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        """Ask the child to stop, then make sure it is gone."""
        if self._stopping:
            return
        self._stopping = True
        self._send(("stop",))
        self._outbox.put(None)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
        self._conn.close()

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

