"""What does CPU that other processes use cost an engine that runs one thread per core?

One engine stepped by the main thread (one request at a time: a 128-token prompt, 128
forced output tokens), timed alone and while another process asks for a share of one
core in short bursts (busy `--burst-ms`, then asleep for as long as the share leaves),
the way a serving stack's processes do: a replica handling a step's message, the client
reading a token, Serve's controller running its loop. The shares run in turn,
`--rounds` times, and each row says the share the other process took (its CPU time over
the engine's wall time).

An OpenMP team's thread that loses its core for a moment holds up its parallel region:
its partner waits at the barrier. So an engine whose team fills the cores loses between
about half the share taken and all of it (docs/benchmarks.md, "Serving
efficiency"), though the other process takes a share of only one of the two
cores. `--threads 1` leaves a core free for it. `--burner-nice 19`
shows what priority does: the other process then gets little of the CPU it asks for,
which the processes that carry a server's tokens to its clients cannot do without.

    .venv/bin/python scripts/experiments/stolen_cpu.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from engine_placement import main_thread_engine, stepped  # this folder is on sys.path when a script in it runs

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags

# The other process: a bare interpreter (no torch, nothing of duet's to import, so its
# start costs no core while the engine is timed) that says when it runs, then busy for
# `burst_s`, asleep for the rest of the period that makes `share` of a core, until killed.
BURNER = """
import os, sys, time
share, burst_s, nice = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
os.nice(nice)
idle_s = burst_s * (1 - share) / share
print("ready", flush=True)
while True:
    end = time.perf_counter() + burst_s
    while time.perf_counter() < end:
        pass
    time.sleep(idle_s)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.05, 0.10, 0.20])
    p.add_argument("--burst-ms", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--burner-nice", type=int, default=0, help="the other process's niceness")
    p.add_argument("--json")
    a = p.parse_args()
    shares = sorted({0.0, *a.shares})  # alone (0) is the baseline, always measured
    engine, sampling = main_thread_engine(a.threads)
    tpot: dict[float, list[float]] = {s: [] for s in shares}
    got: dict[float, list[float]] = {s: [] for s in shares}  # the share the other process got
    for _ in range(a.rounds):
        for share in shares:
            if share == 0:
                tpot[share].append(stepped(engine, sampling, a.requests))
                continue
            burner = subprocess.Popen([sys.executable, "-c", BURNER, str(share), str(a.burst_ms / 1e3),
                                       str(a.burner_nice)], stdout=subprocess.PIPE, text=True)
            assert burner.stdout is not None and burner.stdout.readline().strip() == "ready"
            began = time.perf_counter()
            tpot[share].append(stepped(engine, sampling, a.requests))
            wall = time.perf_counter() - began
            burner.kill()
            burner.stdout.close()
            _, _, usage = os.wait4(burner.pid, 0)  # the CPU it used while the engine ran (and its start, ~20 ms)
            got[share].append((usage.ru_utime + usage.ru_stime) / wall)
    base = statistics.median(tpot[0.0])
    rows = {}
    for share, runs in tpot.items():
        med = statistics.median(runs)
        took = statistics.median(got[share]) if got[share] else 0.0
        rows[str(share)] = {"tpot_ms": runs, "median_ms": med, "speed_of_alone": base / med,
                            "share_taken": got[share]}
        print(f"share {share:4.2f} of a core asked, {took:4.2f} taken: TPOT median {med:6.2f} ms"
              f"  speed {base / med:5.1%} of alone  runs {[round(t, 2) for t in runs]}")
    if a.json:
        write_json(a.json, {"cpu_flags": cpu_flags(), "threads": a.threads, "burst_ms": a.burst_ms,
                            "burner_nice": a.burner_nice, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                            "shares": rows})


if __name__ == "__main__":
    main()
