"""A per-step trace of an engine: when each step started, how long it ran, the size of
its thread team and how many sequences it advanced.

Off unless `DUET_STEP_TRACE` names a folder in the engine's environment; then every
engine (a core process, or the step thread of a replica) appends one line per step to
`<folder>/<role>-<pid>.steps`. A served benchmark reads the lines back to split what a
client measured into the engine's steady state and the rest (a burst's ramp, a tail,
the stack around the engine): `duet bench efficiency --step-trace`.

Times are `time.monotonic()` seconds, one clock for every process of a machine, so a
benchmark can cut a trace at the moments its own points started and ended. One write
per step (line-buffered): 2.8 µs measured, beside steps of tens of milliseconds, and
nothing is lost when Serve kills the process.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ENV = "DUET_STEP_TRACE"


@dataclass(frozen=True, slots=True)
class StepRecord:
    start: float  # time.monotonic() when the step began
    seconds: float
    threads: int  # the OpenMP team the step ran on (most of its layers, where the team changed between them)
    sequences: int  # sequences that produced output in this step


class StepTrace:
    """One engine's trace file, open for appending."""

    def __init__(self, folder: str | Path, role: str):
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{role}-{os.getpid()}.steps"
        self._file: IO[str] = self.path.open("a", buffering=1)

    @classmethod
    def from_env(cls, role: str) -> StepTrace | None:
        folder = os.environ.get(ENV)
        return cls(folder, role) if folder else None

    def record(self, start: float, seconds: float, threads: int, sequences: int) -> None:
        self._file.write(f"{start:.6f} {seconds:.6f} {threads} {sequences}\n")

    def close(self) -> None:
        self._file.close()


def read(folder: str | Path) -> dict[str, list[StepRecord]]:
    """Every trace in `folder`, by file stem (`<role>-<pid>`); a cut last line is skipped."""
    traces = {}
    for path in sorted(Path(folder).glob("*.steps")):
        records = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                records.append(StepRecord(float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])))
        traces[path.stem] = records
    return traces


def role_of(name: str) -> str:
    return name.rsplit("-", 1)[0]


def summarize(records: list[StepRecord], start: float, end: float, full_batch: int) -> dict:
    """One engine's steps between `start` and `end`.

    `busy` is the share of that time spent in steps; `threads` how many steps ran on
    each team size. The steady state is the stretch from the first step that advanced
    `full_batch` sequences or more to the last one: its sequences per second are the
    engine's output rate with the batch full, free of the ramp before and the tail
    after (a sequence makes one token per step unless it speculates).
    """
    steps = [r for r in records if start <= r.start < end]
    if not steps:
        return {"steps": 0}
    span = end - start
    out: dict = {
        "steps": len(steps),
        "busy": sum(r.seconds for r in steps) / span,
        "threads": {str(n): c for n, c in sorted(Counter(r.threads for r in steps).items())},
        "step_ms_p50": 1e3 * statistics.median(r.seconds for r in steps),
    }
    full = [i for i, r in enumerate(steps) if r.sequences >= full_batch]
    if len(full) >= 2:
        window = steps[full[0]:full[-1] + 1]
        seconds = window[-1].start + window[-1].seconds - window[0].start
        team = max(r.threads for r in window)
        out["steady"] = {
            "seconds": seconds,
            "outputs_per_s": sum(r.sequences for r in window) / seconds,
            "mean_batch": sum(r.sequences for r in window) / len(window),
            "busy": sum(r.seconds for r in window) / seconds,
            "full_team": sum(r.threads == team for r in window) / len(window),  # steps on the largest team
        }
    return out
