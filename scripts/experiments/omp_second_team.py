"""Does a second live thread that once ran a parallel torch op slow the engine's steps?

One engine stepped by the main thread (one request at a time: a 128-token prompt, 128
forced output tokens, 2 threads), timed alone, then beside a live thread that ran one
parallel copy of a 128 MB tensor and now waits, then again once that thread has ended.
Run it once as is and once with `OMP_WAIT_POLICY=PASSIVE` (OpenMP workers sleep
between parallel regions instead of spinning): if the engine is as slow alone under
PASSIVE as beside the thread by default, the second thread costs the engine its
workers' spin between regions.

    .venv/bin/python scripts/experiments/omp_second_team.py --json out.json
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/experiments/omp_second_team.py
"""

from __future__ import annotations

import argparse
import os
import threading

import torch
from engine_placement import main_thread_engine, stepped  # this folder is on sys.path when a script in it runs

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    a = p.parse_args()
    engine, sampling = main_thread_engine(a.threads)
    tpot: dict[str, float] = {"alone": stepped(engine, sampling, a.requests)}

    copied, stop = threading.Event(), threading.Event()

    def second_thread() -> None:
        src = torch.randn(32_000_000)
        torch.empty_like(src).copy_(src)  # a parallel op on this thread
        copied.set()
        stop.wait()

    thread = threading.Thread(target=second_thread, daemon=True)
    thread.start()
    copied.wait()
    tpot["beside_the_live_thread"] = stepped(engine, sampling, a.requests)
    stop.set()
    thread.join()
    tpot["after_it_ended"] = stepped(engine, sampling, a.requests)
    print("TPOT " + "  ".join(f"{k} {v:.2f} ms" for k, v in tpot.items())
          + f"  (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})")
    if a.json:
        write_json(a.json, {"cpu_flags": cpu_flags(), "threads": a.threads,
                            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "tpot_ms": tpot})


if __name__ == "__main__":
    main()
