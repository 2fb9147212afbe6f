"""Reports: JSON, Markdown and PNG files from fake results; the knee finder."""

import json

import pytest

from loadgen.arrivals import ArrivalProcess
from loadgen.metrics import compute_metrics, parse_goodput
from loadgen.plots import write_plots
from loadgen.records import Outcome, RequestResult
from loadgen.report import find_knee, load_points, point_report, request_rows, write_json, write_markdown
from loadgen.workloads import WorkloadSpec

pytestmark = pytest.mark.unit


def fake_point(rate: float, slowdown: float) -> dict:
    results = []
    for i in range(6):
        r = RequestResult(i, 0, prompt_tokens=32, max_tokens=4, ignore_eos=True)
        r.send_time = i * 1.0
        r.chunk_times = [r.send_time + slowdown * (0.1 + 0.02 * k) for k in range(4)]
        r.chunk_texts = ["a ", "b ", "c ", "d"]
        r.text, r.end_time, r.outcome = "a b c d", r.chunk_times[-1], Outcome.COMPLETED
        results.append(r)
    results[-1].outcome, results[-1].error, results[-1].chunk_times = Outcome.FAILED, "HTTP 503: busy", []
    m, per = compute_metrics(results, 6.0 / rate, lambda t: len(t.split()), parse_goodput(["ttft:150"]))
    arrival = ArrivalProcess(rate=rate)
    return point_report(arrival, m, request_rows(results, per), WorkloadSpec("random", 6).describe(),
                        {"base_url": "http://fake", "models": {"data": [{"id": "m"}]}},
                        {"model": "m", "endpoint": "completions"})


def test_report_files_from_fake_results(tmp_path):
    points = [fake_point(r, s) for r, s in ((1, 1.0), (2, 1.1), (4, 1.3), (8, 4.0))]
    j = write_json(points, tmp_path)
    md = write_markdown(points, tmp_path)
    pngs = write_plots(points, tmp_path)
    loaded = load_points(j)
    assert len(loaded) == 4 and loaded[0]["arrival"] == {"kind": "poisson", "rate": 1, "burstiness": 1.0}
    assert loaded[0]["server"]["models"]["data"][0]["id"] == "m"
    assert loaded[0]["metrics"]["failed"] == 1 and loaded[0]["requests"][-1]["error"] == "HTTP 503: busy"
    text = md.read_text()
    assert "| rate=8 |" in text and "knee" in text and "ttft ≤ 150 ms" in text
    assert [p.name for p in pngs] == ["latency_vs_throughput.png", "ttft_tpot_cdf.png", "goodput_vs_rate.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    json.dumps(loaded)  # round-trips


def test_find_knee():
    xs = [1, 2, 3, 4, 5]
    assert find_knee(xs, [10, 11, 12, 14, 60]) == 3  # last point before latency explodes
    assert find_knee(xs[:2], [1, 2]) is None
    assert find_knee(xs, [5, 5, 5, 5, 5]) is None
