"""The engine core as its own process: the `Engine` on a child process's main thread.

A replica that sets `engine_process: true` runs its engine here instead of on a side
thread of its own process (`AsyncEngine`), the split vLLM's V1 makes: the step loop
then shares no GIL with the replica's event loop, Serve's streaming calls and the
telemetry, so its Python between products is never stalled by theirs.

The loop is synchronous and busy while there is work: read every command that has
arrived (no waiting), step, send **one message per step** carrying every request's
new outputs, the stats snapshot and the KV events. Idle, it blocks on the pipe (no
CPU). The parent is `engine.core_client.EngineCoreClient`; the channel is a Unix
socket pair with pickled tuples (`Connection`): a step message of 32 outputs
(3.3 kB) costs ~90 us one way, pickling included, against a 60-120 ms step, so a
faster channel (shared memory, ZeroMQ) would buy nothing measurable here
(docs/benchmarks.md).

Messages, parent → child: `("add", call_id, request_id, prompt_ids, sampling,
cache_salt, fork_of)`, `("abort", call_id, request_id)`, `("stop",)`.
Child → parent: `("ready", EngineInfo)` once, `("reply", call_id, ok, value)`,
`("step", outputs, stats, kv_events)`, `("died", message)` before a fatal exit.

Started as `python -m engine.core_process FD`, the socket's descriptor inherited; the
first message on it is `("init", engine_config_dict, role, threads, kv_events)`. The
child exits when the socket closes or its parent changes (the replica died): it is
never an orphan that holds a core.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from engine.structured import GrammarMatcher

IDLE_POLL_S = 0.5  # how often an idle child checks that its parent still lives
GRAMMAR_POLL_S = 0.002  # how often a child with only grammars compiling looks again

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What the replica's side needs to know of the engine, sent once it is warm."""

    model_id: str
    model_fingerprint: str
    block_size: int
    num_kv_blocks: int
    stream_interval: int
    pid: int


@dataclass
class _Add:
    """An `add` command: what the engine's `add_request` takes, and whom to answer."""

    call_id: int
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    fork_of: str | None


class _Core:
    """The child's state: the engine, the grammars being compiled, the pipe."""

    def __init__(self, conn: Connection, engine: Engine, kv_events: bool):
        self.conn = conn
        self.engine = engine
        self.kv_events = kv_events
        # A large JSON schema takes milliseconds or more to compile: never in the step
        # loop. A request waits here until its matcher is ready, then starts.
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="duet-grammar")
        self.compiling: list[tuple[concurrent.futures.Future, _Add]] = []
        self.parent = os.getppid()

    def run(self) -> None:
        while True:
            stepping = self.engine.has_unfinished()
            busy = stepping or bool(self.compiling)
            if not self._read_commands(0.0 if stepping else GRAMMAR_POLL_S if busy else IDLE_POLL_S):
                return
            changed = self._start_compiled()
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                self._send_step(outputs)
            elif changed:
                self._send_step([])
            if not busy and os.getppid() != self.parent:
                return  # the replica is gone (its socket end may live on in a grandchild)

    def _read_commands(self, timeout: float) -> bool:
        """Run every command that has arrived, waiting up to `timeout` for the first;
        False when the parent asked to stop or hung up."""
        while self.conn.poll(timeout):
            timeout = 0.0
            try:
                msg = self.conn.recv()
            except EOFError:
                return False
            if msg[0] == "stop":
                return False
            self._command(msg)
        return True

    def _command(self, msg: tuple) -> None:
        kind, call_id = msg[0], msg[1]
        try:
            if kind == "add":
                add = _Add(*msg[1:])
                if add.sampling.structured is not None:
                    fut = self.grammar_pool.submit(self.engine.grammars.matcher, add.sampling.structured, [])
                    self.compiling.append((fut, add))
                    return  # replied once it starts
                self._add(add, None)
            elif kind == "abort":
                self._drop_compiling(msg[2])
                self.engine.abort(msg[2])
                self._reply(call_id, True, None)
            else:
                raise ValueError(f"unknown engine core command {kind!r}")
        except Exception as e:
            self._reply(call_id, False, e)

    def _drop_compiling(self, request_id: str) -> None:
        """An abort that overtook its request's grammar: that request never starts."""
        for item in [c for c in self.compiling if c[1].request_id == request_id]:
            self.compiling.remove(item)
            item[0].cancel()
            self._reply(item[1].call_id, False, RuntimeError(f"request {request_id} aborted before it started"))

    def _start_compiled(self) -> bool:
        """Start the requests whose grammar is ready; whether any command changed the engine."""
        started = False
        for item in [c for c in self.compiling if c[0].done()]:
            self.compiling.remove(item)
            fut, add = item
            try:
                self._add(add, fut.result())
                started = True
            except Exception as e:
                self._reply(add.call_id, False, e)
        return started

    def _add(self, add: _Add, grammar: GrammarMatcher | None) -> None:
        """Start the request and answer its caller (an error is the caller's to answer)."""
        self.engine.add_request(add.prompt, add.sampling, request_id=add.request_id, grammar=grammar,
                                cache_salt=add.cache_salt, fork_of=add.fork_of)
        self._reply(add.call_id, True, None)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        if not ok:
            value = _portable(value)
        self.conn.send(("reply", call_id, ok, value))

    def _send_step(self, outputs: list) -> None:
        events = self.engine.take_kv_events()
        self.conn.send(("step", outputs, self.engine.stats(), events if self.kv_events else []))


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def main(fd: int) -> int:
    conn = Connection(fd)
    try:
        _, engine_cfg, role, threads, kv_events = conn.recv()
    except EOFError:
        return 1
    try:
        import torch

        from engine.async_engine import warm_up
        from engine.config import EngineConfig
        from engine.engine import Engine

        torch.set_num_threads(threads)
        engine = Engine(EngineConfig.model_validate(engine_cfg), role=role)
        warm_up(engine)
        conn.send(("ready", EngineInfo(engine.model_id, engine.model_fingerprint, engine.cfg.block_size,
                                       engine.block_pool.num_blocks, engine.cfg.stream_interval, os.getpid()),
                   engine.stats()))
        _Core(conn, engine, kv_events).run()
        return 0
    except BaseException as e:
        log.exception("engine core died")
        try:
            conn.send(("died", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    # Run the module's own copy, not `__main__`'s: the classes this pickles (EngineInfo)
    # must be named `engine.core_process.*` for the parent to load them.
    from engine.core_process import main as _main

    sys.exit(_main(int(sys.argv[1])))  # the socket pair's end, inherited
