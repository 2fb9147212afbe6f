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

The messages are engine/core_messages.py's typed dataclasses: `Init`, then `Call`s of
`Add`, `AddImported` (a decode replica's import, with `Reserve` and `Release` around
it), `MoveOut` (a draining decode replica; the reply is the `MovedSequence`s, sent
before the step that ends their streams) and `Abort`, then `Stop`; back come `Ready`
once, a `Reply` per call, a `Step` per engine step (with a prefill engine's `ExportedKV`s
of that step, for the replica to lease before it delivers the outputs) and `Died`
before a fatal exit.

Started as `python -m engine.core_process FD`, the socket's descriptor inherited; the
first message on it is `Init`. Its `external_kv` (an `ExternalKVSpec`, or None) names the
external KV cache (a prefill replica's LMCache tier) that the child builds around its
KV tensor after the warm-up, attaches, and closes as it stops: the tier's reads and
writes of the KV happen inside the engine's step, so the tier lives where the engine
runs. With `share_kv` the KV tensor lives in shared memory, whose descriptor follows
`Ready` on the socket, so a prefill or decode replica registers it with NIXL (or gloo) in its own
process: decode pulls straight into the pages this engine reads, and a decode replica
pulls from the pages a prefill engine wrote. The
child exits when the socket closes or its parent changes (the replica died): it is
never an orphan that holds a core.

With `engine.share_cores` the child sizes its thread team before each step, and
again between the step's layers, to the cores the other busy engine cores of this
machine leave (engine/core_share.py), up to `threads`. With `DUET_STEP_TRACE` set it
appends one line per step to a trace (engine/step_trace.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from engine.core_messages import (
    Abort,
    Add,
    AddImported,
    Call,
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
)
from engine.step_trace import StepTrace

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.core_share import CoreShare
    from engine.engine import Engine, ExportedKV
    from engine.external_kv import ManagedExternalKV
    from engine.sampling_params import SamplingParams
    from engine.structured import GrammarMatcher

IDLE_POLL_S = 0.5  # how often an idle child checks that its parent still lives
GRAMMAR_POLL_S = 0.002  # how often a child with only grammars compiling looks again

log = logging.getLogger(__name__)


@dataclass
class _Start:
    """A command that starts a request (`add`, `add_imported`), and whom to answer. A
    structured request waits for its grammar first; an imported one owns `blocks`
    until it starts (they are freed here if it never does)."""

    call_id: int
    request_id: str
    sampling: SamplingParams
    output_ids: list[int]  # a request taken over: the output its grammar has consumed
    start: Callable[[GrammarMatcher | None], object]
    blocks: list[int] | None = None


class _Core:
    """The child's state: the engine, the grammars being compiled, the pipe."""

    def __init__(self, conn: Connection, engine: Engine, kv_events: bool, external_kv: ManagedExternalKV | None,
                 cores: CoreShare | None):
        self.conn = conn
        self.engine = engine
        self.kv_events = kv_events
        self.external_kv = external_kv
        # A large JSON schema takes milliseconds or more to compile: never in the step
        # loop. A request waits here until its matcher is ready, then starts.
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="duet-grammar")
        self.compiling: list[tuple[concurrent.futures.Future, _Start]] = []
        self.changed = False  # a command changed the engine since the last message
        self.exports: list[ExportedKV] = []
        if engine.role == "prefill":  # the replica leases them: each goes with its step's message
            engine.on_export = self._exported
        self.parent = os.getppid()
        self.cores = cores
        self.team_layers: Counter[int] = Counter()  # this step's layers by the team that ran them
        if cores is not None:
            engine.model.between_layers = self._follow_cores
        self.trace = StepTrace.from_env(engine.role)

    def run(self) -> None:
        while True:
            stepping = self.engine.has_unfinished()
            busy = stepping or bool(self.compiling)
            if not stepping and self.cores is not None:
                self.cores.idle()  # waiting for work: the other engines may use our cores
            if not self._read_commands(0.0 if stepping else GRAMMAR_POLL_S if busy else IDLE_POLL_S):
                return
            self._start_compiled()
            if self.engine.has_unfinished():
                if self.cores is not None:
                    self._use_threads(self.cores.busy())
                self.team_layers.clear()
                self.team_layers[torch.get_num_threads()] += 1
                began = time.monotonic()
                outputs = self.engine.step()
                if self.trace is not None:  # the team that ran most of the step's layers
                    team = self.team_layers.most_common(1)[0][0]
                    self.trace.record(began, time.monotonic() - began, team, len(outputs))
                self._send_step(outputs)
            elif self.changed:  # e.g. blocks reserved or released: the stats moved
                self._send_step([])
            self.changed = False
            if not busy and os.getppid() != self.parent:
                return  # the replica is gone (its socket end may live on in a grandchild)

    @staticmethod
    def _use_threads(n: int) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def _follow_cores(self) -> None:
        """Between two layers of a step: take the cores another engine just left, or give
        back the one it just took."""
        assert self.cores is not None
        n = self.cores.threads_now()
        self._use_threads(n)
        self.team_layers[n] += 1

    def _read_commands(self, timeout: float) -> bool:
        """Run every command that has arrived, waiting up to `timeout` for the first;
        False when the parent asked to stop or hung up."""
        while self.conn.poll(timeout):
            timeout = 0.0
            try:
                msg = self.conn.recv()
            except EOFError:
                return False
            if isinstance(msg, Stop):
                return False
            self.changed = True
            self._command(msg)
        return True

    def _command(self, call: Call) -> None:
        call_id, eng = call.call_id, self.engine
        try:
            match call.command:
                case Add(request_id, prompt, sampling, cache_salt, fork_of):
                    self._start(_Start(call_id, request_id, sampling, [], lambda grammar: eng.add_request(
                        prompt, sampling, request_id=request_id, grammar=grammar, cache_salt=cache_salt,
                        fork_of=fork_of)))
                case AddImported(request_id, prompt, first_token, sampling, blocks, cache_salt, resume):
                    num_output = 1 if resume is None else resume.num_output_tokens
                    self._start(_Start(call_id, request_id, sampling, [*prompt, first_token][-num_output:],
                                       lambda grammar: eng.add_imported_request(
                                           request_id, prompt, first_token, sampling, blocks, grammar=grammar,
                                           cache_salt=cache_salt, resume=resume),
                                       blocks))
                case Abort(request_id):
                    self._drop_compiling(request_id)
                    eng.abort(request_id)
                    self._reply(call_id, True, None)
                case Reserve(num_tokens):
                    self._reply(call_id, True, eng.reserve_import(num_tokens))
                case Release(block_ids):
                    eng.release_blocks(block_ids)
                    self._reply(call_id, True, None)
                case MoveOut(request_ids):
                    moved = [seq for request_id in request_ids if (seq := eng.move_out(request_id)) is not None]
                    self._reply(call_id, True, moved)
                case other:
                    raise ValueError(f"unknown engine core command {other!r}")
        except Exception as e:
            self._reply(call_id, False, e)

    def _start(self, cmd: _Start) -> None:
        if cmd.sampling.structured is None:
            self._run_start(cmd, None)
            return
        fut = self.grammar_pool.submit(self.engine.grammars.matcher, cmd.sampling.structured, cmd.output_ids)
        self.compiling.append((fut, cmd))  # replied once it starts

    def _drop_compiling(self, request_id: str) -> None:
        """An abort that overtook its request's grammar: that request never starts."""
        for item in [c for c in self.compiling if c[1].request_id == request_id]:
            self.compiling.remove(item)
            item[0].cancel()
            self._never_started(item[1], RuntimeError(f"request {request_id} aborted before it started"))

    def _start_compiled(self) -> None:
        """Start the requests whose grammar is ready."""
        for item in [c for c in self.compiling if c[0].done()]:
            self.compiling.remove(item)
            fut, cmd = item
            self.changed = True
            try:
                grammar = fut.result()
            except Exception as e:
                self._never_started(cmd, e)
                continue
            self._run_start(cmd, grammar)

    def _run_start(self, cmd: _Start, grammar: GrammarMatcher | None) -> None:
        """Start the request and answer its caller (an error is the caller's to answer)."""
        try:
            cmd.start(grammar)
        except Exception as e:
            self._never_started(cmd, e)
            return
        self._reply(cmd.call_id, True, None)

    def _never_started(self, cmd: _Start, e: BaseException) -> None:
        if cmd.blocks is not None:
            self.engine.release_blocks(cmd.blocks)
        self._reply(cmd.call_id, False, e)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        if not ok:
            value = _portable(value)
        self.conn.send(Reply(call_id, ok, value))

    def _exported(self, export: ExportedKV) -> None:
        self.exports.append(export)

    def _send_step(self, outputs: list) -> None:
        events = self.engine.take_kv_events()
        exports, self.exports = self.exports, []
        self.conn.send(Step(outputs, self.engine.stats(), events if self.kv_events else [], exports,
                            _counters(self.external_kv)))


def _counters(external_kv: ManagedExternalKV | None) -> dict[str, Any] | None:
    """The external KV cache's counters for a message; None without one."""
    return external_kv.as_dict() if external_kv is not None else None


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
        init: Init = conn.recv()
    except EOFError:
        return 1
    role, threads, kv_events, external_spec = init.role, init.threads, init.kv_events, init.external_kv
    external_kv = None
    cores = None
    try:
        from engine.async_engine import attach_external_kv, warm_up
        from engine.config import EngineConfig
        from engine.core_share import CoreShare
        from engine.engine import Engine
        from engine.kv_cache import SharedKV

        torch.set_num_threads(threads)
        cfg = EngineConfig.model_validate(init.engine)
        engine = Engine(cfg, role=role, share_kv=init.share_kv)
        warm_up(engine)
        if external_spec is not None:
            external_kv = attach_external_kv(engine, external_spec)
        if cfg.share_cores:
            cores = CoreShare(threads)
        conn.send(Ready(EngineInfo(engine.model_id, engine.model_fingerprint, engine.cfg.block_size,
                                   engine.block_pool.num_blocks, engine.cfg.stream_interval, os.getpid(),
                                   engine.kv_cache.share()),
                        engine.stats(), _counters(external_kv)))
        if engine.kv_cache.memfd is not None:  # right behind `Ready`, before any other message
            SharedKV.send(fd, engine.kv_cache.memfd)
        _Core(conn, engine, kv_events, external_kv, cores).run()
        return 0
    except BaseException as e:
        log.exception("engine core died")
        try:
            conn.send(Died(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        except OSError:
            pass
        return 1
    finally:
        if cores is not None:
            cores.close()
        if external_kv is not None:
            external_kv.close()  # bounded by its spec's close_timeout_s, which the parent waits for


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    # Run the module's own copy, not `__main__`'s: what this module's code pickles must
    # name modules the parent can import.
    from engine.core_process import main as _main

    code = _main(int(sys.argv[1]))  # the socket pair's end, inherited
    # Not sys.exit: an external cache whose close timed out may have left threads
    # behind that the interpreter's shutdown would wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
