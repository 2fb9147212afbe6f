"""Cores shared between the engine core processes of one machine.

A prefill and a decode engine colocated on a few cores each get a static share of
them: each runs one OpenMP team, and while one pool idles its cores idle with it.
Giving each team every core instead makes the two teams preempt each other inside
their barriers whenever both are busy, which is slower still (docs/benchmarks.md).

`CoreShare` hands the idle cores over. Every engine core process that shares
(`engine.share_cores`) holds one slot in a small table in shared memory, one per
machine and user, and writes there when it last started a step (0 while it waits for
work). Before each step an engine counts the others that are busy now and sizes its
team to the cores they leave: `threads` when it is alone, its share when both pools
are busy. At one request in flight the prefill step and the decode steps each get
every core, as one aggregated engine's would. Between the layers of a step it counts
again (`threads_now`, from the model's `between_layers` hook), so a decode step takes
back the core a prefill step just left, or gives it up to one that just started,
within a layer rather than at its next step.

A slot whose step started over `BUSY_FOR_S` ago counts as idle (an engine that died
mid-step frees its cores that way); a slot whose process is gone is taken by the
next engine that starts.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path

SLOTS = 64
_SLOT = struct.Struct("qq")  # pid, monotonic ns when its current step started (0: idle)
BUSY_FOR_S = 2.0  # longer than any step: a busy mark older than this is stale


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU
    quota where one is set (a container limited to 4 CPUs on a 64-core node gets 4,
    not 64: a team larger than the quota spends its time throttled at a barrier)."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return cores if quota is None else max(1, min(cores, quota))


def _cgroup_quota() -> int | None:
    """The cgroup's CPU limit in whole cores, rounded up (v2, then v1); None: unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else -(-int(quota) // int(period))
    except (OSError, ValueError):
        pass
    try:
        v1 = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        return None if v1 <= 0 else -(-v1 // int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text()))
    except (OSError, ValueError):
        return None


def team_size(threads: int | None) -> int:
    """A pool's `threads` setting as a team size: None is every available core."""
    return threads if threads is not None else available_cores()


def table_path() -> Path:
    """One table per machine and user: every engine core of this user here shares its cores."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"duet-cores-{os.getuid()}"


class CoreShare:
    """This process's slot in the machine's table, and the team size it may use now."""

    def __init__(self, max_threads: int, path: Path | None = None, cores: int | None = None):
        self.max_threads = max_threads
        self.cores = cores if cores is not None else available_cores()
        self.path = path or table_path()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = SLOTS * _SLOT.size
            fcntl.flock(fd, fcntl.LOCK_EX)  # one claimant at a time
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self._table = mmap.mmap(fd, size)
                self._slot = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._busy = False
        self._others: list[int] = []  # offsets of the other live slots, as of the last busy()

    def _claim(self) -> int:
        for slot in range(SLOTS):
            pid, _ = _SLOT.unpack_from(self._table, slot * _SLOT.size)
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._table, slot * _SLOT.size, os.getpid(), 0)
                return slot
        raise RuntimeError(f"more than {SLOTS} engine cores share {self.path}")

    def busy(self) -> int:
        """Mark this engine busy (a step starts) and say how many threads it may run."""
        now = time.monotonic_ns()
        _SLOT.pack_into(self._table, self._slot * _SLOT.size, os.getpid(), now)
        self._busy = True
        stale = now - int(BUSY_FOR_S * 1e9)
        others = 0
        self._others = []
        for slot in range(SLOTS):
            if slot != self._slot:
                pid, since = _SLOT.unpack_from(self._table, slot * _SLOT.size)
                if pid != 0:
                    self._others.append(slot * _SLOT.size)
                    others += since > stale
        return max(1, min(self.max_threads, self.cores - others))

    def threads_now(self) -> int:
        """How many threads this busy engine may run now, read in the middle of a step.

        A step of tens of milliseconds outlives the other engine's state: a decode step
        sized while a prefill step ran would finish on one core after that prefill
        ended, and one sized while prefill idled would run on both cores beside a
        prefill that started. Read between layers, a team follows the other engines
        within a layer. Only the slots that held a process at the step's start are
        read (an engine that starts mid-step counts from the next step on): 0.4 us.
        """
        stale = time.monotonic_ns() - int(BUSY_FOR_S * 1e9)
        others = 0
        for offset in self._others:
            others += _SLOT.unpack_from(self._table, offset)[1] > stale
        return max(1, min(self.max_threads, self.cores - others))

    def idle(self) -> None:
        """Mark this engine idle (it waits for work): its cores are the others' to use."""
        if self._busy:
            _SLOT.pack_into(self._table, self._slot * _SLOT.size, os.getpid(), 0)
            self._busy = False

    def close(self) -> None:
        _SLOT.pack_into(self._table, self._slot * _SLOT.size, 0, 0)
        self._table.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
