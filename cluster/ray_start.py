"""Starting a new local Ray cluster that survives a loaded machine.

`ray.init(address="local")` starts a GCS and a raylet, then waits a fixed 30 s (not
configurable in Ray 2.60: `ray/_private/node.py`) for the raylet to register with the
GCS. On a 2-core machine whose cores are busy (a test suite beside it, a package
install) that wait can run out although nothing is wrong, and Ray raises "The current
node timed out during startup". `init_local` then stops what the try started and tries
again, and if every try fails says why, with the machine's load.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NODE_START_TRIES = 3
_NODE_TIMED_OUT = "timed out during startup"


def init_local(tries: int = NODE_START_TRIES, **init_kwargs: Any) -> None:
    """`ray.init(address="local", **init_kwargs)`, tried up to `tries` times when Ray's
    node start times out."""
    import ray

    for attempt in range(1, tries + 1):
        before = _children()
        try:
            ray.init(address="local", **init_kwargs)
            return
        except Exception as e:
            if _NODE_TIMED_OUT not in str(e):
                raise
            _stop_started(before)
            if attempt == tries:
                raise RuntimeError(
                    f"Ray's node did not register with its GCS within Ray's fixed 30 s, {tries} times; the "
                    f"machine is overloaded (load average {_load()} on {os.cpu_count()} cores): stop what "
                    "competes for the cores, or start Ray yourself (`ray start --head`) and pass "
                    "--address auto") from e
            log.warning("Ray's node start timed out (try %d of %d, load average %s): trying again", attempt,
                        tries, _load())
            time.sleep(1.0)


def _children() -> set[int]:
    """Pids of this process's children (the GCS, raylet and helpers a start spawns)."""
    me = os.getpid()
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:  # the parent pid is the 2nd field after the command in parentheses
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                pids.add(int(proc.name))
        except (OSError, IndexError, ValueError):  # ended while we read it
            continue
    return pids


def _stop_started(before: set[int]) -> None:
    """Kill what a failed start left running (its raylet's workers share its fate)."""
    import ray

    try:
        ray.shutdown()
    except Exception:
        log.debug("ray.shutdown after a failed start", exc_info=True)
    for pid in _children() - before:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
