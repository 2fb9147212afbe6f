"""CPU seconds spent by the integration session: this pytest process and every process it
started (Ray's own, the Serve replicas, their engine cores), for the per-config report.

Under a busy neighbour the suite gets only the CPU it can claim, so what a config costs
is its CPU more than its wall time. `/proc/stat` cannot tell: the stages that run beside
integration (scripts/test.sh) share the machine. A daemon thread samples the process
tree once a second and keeps each process's last-seen user + system time, so a process
that ends between two samples loses at most its last second. It also keeps each
process's kind (its Ray title, or its program), so the session can say which kinds of
process spent the CPU.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import psutil


class TreeCPU:
    """Monotonic CPU seconds of this process and its descendants, alive or ended."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._root = psutil.Process()
        # (pid, start time) → CPU seconds at its last sample: a reused pid is a new key.
        self._last: dict[tuple[int, float], float] = {}
        self._kind: dict[tuple[int, float], str] = {}
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
        seen, kinds = {}, {}
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    key = (p.pid, p.create_time())
                    seen[key] = t.user + t.system  # not children_*: they are sampled
                    kinds[key] = process_kind(p.cmdline())  # a Ray worker's title changes
            except psutil.Error:  # ended since the listing
                continue
        with self._lock:
            self._last.update(seen)
            # An ended process (a zombie) has no command line: keep the kind it had.
            self._kind.update((key, kind) for key, kind in kinds.items() if kind != "?" or key not in self._kind)

    def seconds(self) -> float:
        """CPU seconds so far, sampled now."""
        self._sample()
        with self._lock:
            return sum(self._last.values())

    def by_kind(self) -> list[tuple[str, float, int]]:
        """(kind, CPU seconds, processes) so far, the most CPU first."""
        self._sample()
        totals: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        with self._lock:
            for key, seconds in self._last.items():
                kind = self._kind.get(key, "?")
                totals[kind] += seconds
                counts[kind] += 1
        return [(kind, seconds, counts[kind]) for kind, seconds in totals.most_common()]


def process_kind(cmdline: list[str]) -> str:
    """A short name for what a process is: a Ray worker's title (`ray::ServeReplica:duet:Decode`),
    a module run with -m, or the program (`raylet`, `pytest`, a script's file name)."""
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    if "-m" in cmdline[:-1]:
        return cmdline[cmdline.index("-m") + 1]
    scripts = [a for a in cmdline[1:] if a.endswith(".py")]
    return os.path.basename(scripts[0] if scripts else cmdline[0])
