"""CPU seconds spent by the integration session: this pytest process and every process it
started (Ray's own, the Serve replicas, their engine cores), for the per-config report.

Under a busy neighbour the suite gets only the CPU it can claim, so what a config costs
is its CPU more than its wall time. `/proc/stat` cannot tell: the stages that run beside
integration (scripts/test.sh) share the machine. A daemon thread samples the process
tree once a second and keeps each process's last-seen user + system time, so a process
that ends between two samples loses at most its last second.
"""

from __future__ import annotations

import threading
import time

import psutil


class TreeCPU:
    """Monotonic CPU seconds of this process and its descendants, alive or ended."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._root = psutil.Process()
        # (pid, start time) → CPU seconds at its last sample: a reused pid is a new key.
        self._last: dict[tuple[int, float], float] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, args=(interval_s,), name="tree-cpu", daemon=True).start()

    def _run(self, interval_s: float) -> None:  # for the session's life (a daemon thread)
        while True:
            time.sleep(interval_s)
            self._sample()

    def _sample(self) -> None:
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return
        seen = {}
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    seen[(p.pid, p.create_time())] = t.user + t.system  # not children_*: they are sampled
            except psutil.Error:  # ended since the listing
                continue
        with self._lock:
            self._last.update(seen)

    def seconds(self) -> float:
        """CPU seconds so far, sampled now."""
        self._sample()
        with self._lock:
            return sum(self._last.values())
