"""`CoreRestarts`: a replica starts a new engine core when its child process dies.

The engine core child (engine/core_process.py) is the likeliest process of a replica
to die: it holds the weights and the KV, so the OOM killer picks it first. Its replica
learns at once (the client's reader thread sees the socket close) and repairs itself
in place instead of waiting for Serve's health check to replace the whole replica:

- while the engine is lost, `serving` is False: the replica's own pipeline sends new
  passes elsewhere (`lost_replica`), and its routing stats tell every router;
- what ran on the lost engine has failed with `EngineDead` already (the pipeline
  migrates a decode pass, retries a prefill) and nothing is freed twice: a dead engine's
  blocks need no freeing (`EngineCoreClient.release_blocks`);
- the replica builds a new engine core, and what is bound to one (transfer backend,
  lease exporter, importer), on this class's thread, with backoff between failed tries;
  the old ones are retired once their leases have ended (the KV they lease is still
  mapped in the replica, so a finished prefill's handle stays good);
- a decode or aggregated call that reaches the replica meanwhile (no other replica of
  its pool serves) waits for the new engine (`wait_for_engine`) instead of failing;
- Serve's health check fails only after `max_failures` starts in a row have failed:
  then replacing the replica is the better repair.

Only an engine in a child process is restarted this way: an engine on a thread of the
replica (a CUDA device) shares the replica's fate.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from engine.request import EngineDead

log = logging.getLogger(__name__)

MAX_FAILURES = 3  # starts in a row that failed before the health check gives up
BACKOFF_S = 1.0  # after the first failed start; doubled after each, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 8.0
# How long a call waits for a lost engine core's replacement (the gateway's request
# deadline may end it sooner: a 504 then).
WAIT_FOR_RESTART_S = 60.0


class CoreRestarts:
    """Owns one replica's engine core restarts: when to try, how often, what they cost.

    `restart` builds and installs a new engine core (blocking, a few seconds: the
    weights come from the converted copy); it raises if the new core did not start."""

    def __init__(self, restart: Callable[[], None], what: str, *, max_failures: int = MAX_FAILURES,
                 backoff_s: float = BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S) -> None:
        self._restart = restart
        self.what = what
        self.max_failures = max_failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = False  # a loss not yet repaired (a second one while repairing: once more)
        self._closed = threading.Event()
        self.lost_since: float | None = None  # monotonic; None while the engine serves
        self.restarts = 0  # engine cores started after a loss
        self.failures = 0  # failed starts in a row
        self.failed_starts = 0  # failed starts in all
        self.last_down_s = 0.0  # how long the last repaired loss kept the replica from serving
        self.last_error = ""

    @property
    def serving(self) -> bool:
        return self.lost_since is None

    def lost(self, error: BaseException) -> None:
        """The current engine core died (from any thread): start a new one."""
        with self._lock:
            if self._closed.is_set():
                return
            self._pending = True
            if self.lost_since is None:
                self.lost_since = time.monotonic()
            self.last_error = str(error)
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="duet-engine-core-restart", daemon=True)
            self._thread.start()
        log.error("%s: engine core lost (%s); starting a new one", self.what, error)

    def _run(self) -> None:
        delay = self.backoff_s
        while not self._closed.is_set():
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                self._pending = False
            try:
                self._restart()
            except Exception as e:
                with self._lock:
                    self.failures += 1
                    self.failed_starts += 1
                    self.last_error = str(e)
                    self._pending = self.failures < self.max_failures
                log.exception("%s: engine core restart %d failed", self.what, self.failures)
                if self.failures >= self.max_failures:
                    log.error("%s: %d engine core starts failed in a row; the health check now fails",
                              self.what, self.failures)
                self._closed.wait(delay)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            with self._lock:
                self.restarts += 1
                self.failures = 0
                if not self._pending and self.lost_since is not None:  # not lost again meanwhile
                    self.last_down_s = time.monotonic() - self.lost_since
                    self.lost_since = None
            log.warning("%s: engine core restarted (%d so far; %.1f s without one)", self.what, self.restarts,
                        self.last_down_s)
            delay = self.backoff_s

    @property
    def gave_up(self) -> bool:
        return self.failures >= self.max_failures

    async def wait_for_engine(self, healthy: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until `healthy()` (the replica's current engine
        answers): a request that reaches the replica while its engine core is being
        replaced, or just before the loss was seen, waits for capacity instead of
        failing. False when the restarts gave up or the time ran out."""
        deadline = time.monotonic() + timeout_s
        while not healthy():
            if self.gave_up or self._closed.is_set() or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def check_health(self) -> None:
        """Raise once restarts have failed `max_failures` times in a row (Serve then
        replaces the replica); a restart under way is not a failure."""
        if self.gave_up:
            raise EngineDead(f"{self.what}: {self.failures} engine core starts failed in a row: {self.last_error}")

    def stats(self) -> dict[str, float]:
        """What the replica's stats and metrics carry of it."""
        return {
            "engine_restarts": self.restarts,
            "engine_restart_failures": self.failed_starts,
            "engine_serving": int(self.serving),
            "engine_last_down_s": round(self.last_down_s, 3),
        }

    def close(self) -> None:
        """No restart after this (the replica is stopping)."""
        self._closed.set()
