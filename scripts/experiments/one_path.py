"""The one serving path against the layouts it replaced, as a user would drive them.

Each layout is a `duet serve` command line run from a checkout (this one, or a
baseline checkout given by `--baseline-tree`, e.g. the commit before the relay gateway
was removed, whose fastest layouts were `deploy/*-direct.yaml`), driven by `duet bench
serve` from this checkout in a process of its own: random 128-token prompts, 128 forced
output tokens, closed loops at concurrency 1, 8 and 32, then one 512-token prompt at a
time with one output token (its TTFT is the prefill). Every layout starts on a fresh
Ray cluster; rounds alternate the order (A B C D, D C B A, ...) because these
machines' speed drifts within minutes; the table is the median of the rounds.

    git worktree add --detach /tmp/before 9414a34
    .venv/bin/python scripts/experiments/one_path.py --baseline-tree /tmp/before \\
        --rounds 3 --json out/one_path.json
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.json_output import write_json  # noqa: E402
from bench.loadgen_subprocess import run_loadgen, summarize  # noqa: E402
from bench.machine_ceilings import cpu_flags  # noqa: E402

URL = "http://127.0.0.1:8000"
# (name, which checkout, `duet serve` arguments)
LAYOUTS = {
    "pd": ("this", []),
    "pd-direct (baseline)": ("baseline", ["--config", "deploy/disaggregated-direct.yaml"]),
    "aggregated": ("this", ["--mode", "aggregated"]),
    "aggregated-direct (baseline)": ("baseline", ["--config", "deploy/aggregated-direct.yaml"]),
}
# (label, concurrency, prompts, input tokens, output tokens)
POINTS = [("c=1", 1, 4, 128, 128), ("c=8", 8, 16, 128, 128), ("c=32", 32, 32, 128, 128),
          ("prefill-512", 1, 3, 512, 1)]


def _ready(deadline_s: float, proc: subprocess.Popen) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"duet serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(URL + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"duet serve not ready within {deadline_s:.0f} s")


def _stop(proc: subprocess.Popen, tree: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # Whatever a checkout's `duet serve` left behind (its Ray, Serve's HAProxy).
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], cwd=tree,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    subprocess.run(["pkill", "-f", "haproxy"], check=False)


def serve_and_drive(name: str, tree: Path, args: list[str], seed: int, log_dir: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    log = open(log_dir / f"{name.split()[0]}-{seed}.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "duet"), "serve", *args], cwd=tree, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        _ready(600, proc)
        for i, (label, conc, n, n_in, n_out) in enumerate(POINTS):
            with tempfile.TemporaryDirectory() as d:
                point = run_loadgen(URL, Path(d), [
                    "--concurrency", str(conc), "--num-prompts", str(n), "--seed", str(seed + i),
                    "--input-len", str(n_in), "--output-len", str(n_out), "--ignore-eos", "--warmup", "2"])[0]
            row = dict(summarize(point), point=label)
            if n_out == 1:
                row["prefill_tok_s"] = n_in / (row["ttft_p50_ms"] / 1000)
            rows.append(row)
            print(f"  {name} {label}: {row['output_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms",
                  flush=True)
    finally:
        _stop(proc, tree)
        log.close()
    return rows


def table(rounds: list[dict[str, list[dict]]]) -> str:
    def med(layout: str, label: str, key: str) -> float | None:
        vals = [next(r for r in rnd[layout] if r["point"] == label).get(key) for rnd in rounds if layout in rnd]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    lines = ["| layout | c=1 tok/s | c=1 TTFT p50 | c=1 to 2nd token p50 | c=8 tok/s | c=8 TPOT p50 "
             "| c=32 tok/s | c=32 TPOT p50 | 512-token prefill tok/s | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for layout in rounds[0]:
        failed = sum(r["failed"] for rnd in rounds for r in rnd.get(layout, []))
        cells = [f"{med(layout, 'c=1', 'output_tok_s'):.1f}", f"{med(layout, 'c=1', 'ttft_p50_ms'):.0f} ms",
                 f"{med(layout, 'c=1', 'ttst_p50_ms'):.0f} ms",
                 f"{med(layout, 'c=8', 'output_tok_s'):.1f}", f"{med(layout, 'c=8', 'tpot_p50_ms'):.0f} ms",
                 f"{med(layout, 'c=32', 'output_tok_s'):.1f}", f"{med(layout, 'c=32', 'tpot_p50_ms'):.0f} ms",
                 f"{med(layout, 'prefill-512', 'prefill_tok_s'):.0f}", str(failed)]
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/experiments/one_path.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a checkout whose deploy/*-direct.yaml layouts are the baseline (left out: only this one's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=None, help=f"a subset of: {', '.join(LAYOUTS)}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    trees = {"this": ROOT, "baseline": a.baseline_tree}
    names = [n for n in (a.layouts or LAYOUTS) if trees[LAYOUTS[n][0]] is not None]
    log_dir = Path(tempfile.mkdtemp(prefix="duet-one-path-"))
    print(f"CPU flags: {' '.join(cpu_flags())}; serve logs in {log_dir}", flush=True)
    rounds: list[dict[str, list[dict]]] = []
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        rnd: dict[str, list[dict]] = {}
        for name in order:
            which, args = LAYOUTS[name]
            rnd[name] = serve_and_drive(name, trees[which], args, seed=1000 + 10 * r, log_dir=log_dir)
        rounds.append({n: rnd[n] for n in names})
    print(table(rounds))
    if a.json:
        write_json(a.json, {"cpu_flags": cpu_flags(), "points": POINTS, "layouts": {n: LAYOUTS[n] for n in names},
                            "rounds": rounds, "table": table(rounds)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
