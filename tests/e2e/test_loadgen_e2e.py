"""loadgen end to end against the session's real `duet serve` (tests/e2e/conftest.py): a short `duet bench serve` sweep
writes JSON, Markdown and PNGs, and `duet plan --validate`, fitted on two tiny
measured sweeps, prints the simulator's prediction against what the server did.

The error of the prediction is printed (run with -s to see it), never asserted: on a
shared 2-core machine the timings say as much about the neighbours as about duet.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from serve_process import DUET, Served

pytestmark = pytest.mark.e2e

PNGS = ("latency_vs_throughput.png", "ttft_tpot_cdf.png", "goodput_vs_rate.png")


@pytest.fixture
def server(served: Served) -> str:
    """The session's `duet serve` (tests/e2e/conftest.py): 1 prefill + 1 decode."""
    return served.url


def duet(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([DUET, *args], capture_output=True, text=True, timeout=timeout)


def check_outputs(out: Path, n_points: int, submitted: int) -> list[dict]:
    assert (out / "summary.md").read_text().startswith("# Benchmark summary")
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    points = json.loads((out / "results.json").read_text())
    assert isinstance(points, list) and len(points) == n_points
    for p in points:
        assert {"label", "arrival", "workload", "server", "run", "metrics", "requests"} <= p.keys()
        assert p["server"]["models"]["data"][0]["id"] == p["run"]["model"]
        m = p["metrics"]
        assert m["submitted"] == submitted == len(p["requests"])
        assert m["completed"] > 0 and m["completed"] + m["failed"] + m["unfinished"] == submitted
    return points


def test_bench_serve_sweep_writes_reports(server, tmp_path):
    out = tmp_path / "bench"
    r = duet("bench", "serve", "--base-url", server, "--input-len", "uniform:16:48", "--output-len", "8",
             "--ignore-eos", "--num-prompts", "8", "--request-rate", "2", "4", "--goodput", "ttft:2000", "tpot:500",
             "--no-progress", "--out", str(out))
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    points = check_outputs(out, n_points=2, submitted=8)
    assert [p["arrival"]["rate"] for p in points] == [2.0, 4.0]
    assert all(p["workload"]["output_len_mode"] == "forced" for p in points)
    done = [row for p in points for row in p["requests"] if row["outcome"] == "completed"]
    assert all(row["output_tokens"] == 8 and row["server_completion_tokens"] == 8 for row in done)
    assert "| rate=2 " in r.stdout and "| rate=4 " in r.stdout


def test_plan_validate_against_live_server(server, tmp_path):
    pre, dec, plan = tmp_path / "pre", tmp_path / "dec", tmp_path / "plan.json"
    r = duet("bench", "serve", "--base-url", server, "--workload", "long-in-short-out",
             "--input-len", "uniform:64:320", "--output-len", "1", "--num-prompts", "5", "--request-rate", "0.5",
             "--no-progress", "--out", str(pre))
    assert r.returncode == 0, r.stdout + r.stderr
    check_outputs(pre, n_points=1, submitted=5)
    r = duet("bench", "serve", "--base-url", server, "--workload", "short-in-long-out", "--input-len", "16",
             "--output-len", "16", "--ignore-eos", "--num-prompts", "4", "--concurrency", "1", "4",
             "--no-progress", "--out", str(dec))
    assert r.returncode == 0, r.stdout + r.stderr
    check_outputs(dec, n_points=2, submitted=4)

    r = duet("plan", "--prefill-sweep", str(pre / "results.json"), "--decode-sweep", str(dec / "results.json"),
             "--rate", "0.5", "--input-len", "uniform:32:128", "--output-len", "16", "--goodput", "ttft:5000",
             "tpot:1000", "--goodput-target", "0.8", "--num-requests", "300", "--validate", "--base-url", server,
             "--validate-num-prompts", "8", "--no-progress", "--out", str(plan),
             "--validate-out", str(tmp_path / "validation"))
    print(r.stdout)
    # 1 = infeasible plan: still validated; never a crash.
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "recommendation for 0.5 req/s" in r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("metric"))
    assert header.split() == ["metric", "predicted", "measured", "error"]
    v = json.loads(plan.read_text())["validation"]
    rows = {row["metric"]: row for row in v["comparison"]}
    assert {"ttft_p50_ms", "tpot_p50_ms", "goodput_ratio"} <= rows.keys()
    for k in ("ttft_p50_ms", "tpot_p50_ms"):
        assert rows[k]["predicted"] > 0 and rows[k]["measured"] > 0 and math.isfinite(rows[k]["rel_error"])
        assert f"{rows[k]['rel_error']:+.0%}" in r.stdout
    assert 0 <= rows["goodput_ratio"]["measured"] <= 1
    check_outputs(tmp_path / "validation", n_points=1, submitted=8)
