"""Reports of a sweep: one JSON object per sweep point and a Markdown summary.

A point object carries everything needed to re-plot or re-plan without the server:
the workload, the arrival process, the server's `/v1/models` answer, the metrics,
and one compact row per measured request (the planner fits on these rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.arrivals import ArrivalProcess
from loadgen.metrics import BenchMetrics, RequestMetrics
from loadgen.records import Outcome, RequestResult


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def request_rows(results: list[RequestResult], per: list[RequestMetrics],
                 t0: float | None = None) -> list[dict[str, Any]]:
    """One row per measured request; `per` is in the order of completed results.
    With `t0` (the point's start), each row has `start_ms`, its send time after it."""
    it = iter(per)
    rows = []
    for r in results:
        if r.warmup:
            continue
        row: dict[str, Any] = {"session": r.session_id, "turn": r.turn_index, "outcome": r.outcome.value,
                               "prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens}
        if t0 is not None:
            row["start_ms"] = _ms(r.send_time - t0)
        if r.outcome is Outcome.COMPLETED:
            m = next(it)
            row.update(output_tokens=m.output_tokens, ttft_ms=_ms(m.ttft), tpot_ms=_ms(m.tpot), e2el_ms=_ms(m.e2el))
            if r.usage:
                row["server_completion_tokens"] = r.usage.get("completion_tokens")
                # Prompt tokens the server found in its prefix cache (OpenAI's usage field).
                row["server_cached_tokens"] = (r.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        else:
            row["error"] = r.error
            row["http_status"] = r.http_status
        rows.append(row)
    return rows


def point_report(
    arrival: ArrivalProcess,
    metrics: BenchMetrics,
    rows: list[dict[str, Any]],
    workload: dict[str, Any],
    server: dict[str, Any],
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "label": arrival.label,
        "x": arrival.x_value,
        "arrival": arrival.describe(),
        "workload": workload,
        "server": server,
        "run": run_info or {},
        "metrics": metrics.to_dict(),
        "requests": rows,
    }


def write_json(points: list[dict[str, Any]], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(points, indent=1))
    return path


def load_points(path: str | Path) -> list[dict[str, Any]]:
    """Points from a `results.json` (a list) or a single point object."""
    data = json.loads(Path(path).read_text())
    return data if isinstance(data, list) else [data]


def find_knee(xs: list[float], ys: list[float]) -> int | None:
    """Index of the knee of a rising latency-vs-throughput curve: the point farthest
    below the chord from the first to the last point, both axes normalized
    (Kneedle's idea). None with fewer than 3 points or a flat curve."""
    if len(xs) < 3:
        return None
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    order = np.argsort(x)
    x, y = x[order], y[order]
    span_x, span_y = x[-1] - x[0], y.max() - y.min()
    if span_x <= 0 or span_y <= 0:
        return None
    xn, yn = (x - x[0]) / span_x, (y - y.min()) / span_y
    chord = yn[0] + (yn[-1] - yn[0]) * xn
    d = chord - yn
    k = int(np.argmax(d))
    return int(order[k]) if d[k] > 0 else None


def _f(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def markdown_summary(points: list[dict[str, Any]]) -> str:
    if not points:
        return "# Benchmark summary\n\nNo sweep points.\n"
    first = points[0]
    wl, srv = first["workload"], first["server"]
    lines = [
        "# Benchmark summary",
        "",
        f"- server: `{srv.get('base_url', '?')}`; model: `{first['run'].get('model', '?')}`; "
        f"endpoint: `{first['run'].get('endpoint', '?')}`",
        f"- workload: `{wl.get('kind')}`, input `{wl.get('input_len')}`, output `{wl.get('output_len')}` "
        f"({wl.get('output_len_mode')} output length), seed {wl.get('seed')}",
    ]
    slo = first["metrics"].get("slo") or {}
    if slo:
        lines.append("- goodput SLO: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items()))
    ms = [p["metrics"] for p in points]
    knee = find_knee([m["request_throughput"] for m in ms], [m["e2el_ms"]["mean"] or 0.0 for m in ms])
    header = ("| point | done/fail/unfin | req/s | out tok/s | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 "
              "| ITL p99 | E2EL mean | goodput req/s (ratio) |")
    lines += ["", header, "|" + "---|" * (header.count("|") - 1)]
    for i, (p, m) in enumerate(zip(points, ms)):
        good = "–" if m.get("goodput") is None else f"{m['goodput']:.2f} ({m['goodput_ratio']:.2f})"
        label = p["label"] + (" **knee**" if i == knee else "")
        lines.append(
            f"| {label} | {m['completed']}/{m['failed']}/{m['unfinished']} | {m['request_throughput']:.2f} "
            f"| {m['output_throughput']:.1f} | {_f(m['ttft_ms']['mean'])} | {_f(m['ttft_ms']['p99'])} "
            f"| {_f(m['tpot_ms']['mean'])} | {_f(m['tpot_ms']['p99'])} | {_f(m['itl_ms']['p99'])} "
            f"| {_f(m['e2el_ms']['mean'])} | {good} |"
        )
    lines += ["", "Latencies in ms. Failed and unfinished requests count in the goodput ratio's denominator.", ""]
    return "\n".join(lines)


def write_markdown(points: list[dict[str, Any]], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.md"
    path.write_text(markdown_summary(points))
    return path
