"""`duet bench serve` (loadgen) driven from a benchmark: one subprocess per sweep
against a running `duet serve`, and the figures the serving benchmarks tabulate.

The client runs in its own process, as a user's would: it shares no interpreter
with the benchmark's Ray driver, and its figures are the ones `duet bench serve`
prints for the same command line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_loadgen(url: str, out: Path, args: list[str]) -> list[dict]:
    """Run `python -m loadgen bench-serve` against `url` with `args`; its points."""
    cmd = [sys.executable, "-m", "loadgen", "bench-serve", "--base-url", url, "--no-progress", "--out", str(out), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())


def summarize(point: dict) -> dict:
    """One loadgen point as a row: counts, TTFT and TPOT p50/p99, time to the second
    chunk p50, output tokens/s."""
    m = point["metrics"]
    return {
        "label": point.get("label", ""),
        "completed": m["completed"],
        "failed": m["failed"],
        "ttft_p50_ms": m["ttft_ms"]["median"],
        "ttft_p99_ms": m["ttft_ms"]["p99"],
        "tpot_p50_ms": m["tpot_ms"]["median"],
        "tpot_p99_ms": m["tpot_ms"]["p99"],
        "ttst_p50_ms": (m.get("ttst_ms") or {}).get("median"),
        "output_tok_s": m["output_throughput"],
    }
