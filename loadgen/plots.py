"""PNG plots of a sweep (matplotlib, Agg backend, so no display is needed):
latency against throughput with the knee marked, TTFT and TPOT CDFs, and goodput
(or throughput, without an SLO) against the offered rate or concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from loadgen.report import find_knee  # noqa: E402


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_vs_throughput(points: list[dict[str, Any]], path: Path) -> Path:
    ms = [p["metrics"] for p in points]
    x = [m["request_throughput"] for m in ms]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, stat, title in (
        (axes[0], "ttft_ms", "p99", "TTFT p99"),
        (axes[1], "tpot_ms", "p99", "TPOT p99"),
        (axes[2], "e2el_ms", "mean", "E2E latency mean"),
    ):
        y = [m[key][stat] if m[key][stat] is not None else np.nan for m in ms]
        ax.plot(x, y, "o-")
        for xi, yi, p in zip(x, y, points):
            ax.annotate(p["label"].split("=")[-1], (xi, yi), fontsize=7, textcoords="offset points", xytext=(3, 3))
        k = find_knee(x, [0.0 if np.isnan(v) else v for v in y])
        if k is not None:
            ax.plot([x[k]], [y[k]], "r*", markersize=14, label="knee")
            ax.legend()
        ax.set(xlabel="completed requests/s", ylabel="ms", title=title)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def latency_cdfs(points: list[dict[str, Any]], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for p in points:
            v = np.sort([r[key] for r in p["requests"] if r.get(key) is not None])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=p["label"])
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of completed requests", title=f"{title} CDF")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, path)


def goodput_vs_rate(points: list[dict[str, Any]], path: Path) -> Path:
    ms = [p["metrics"] for p in points]
    x = [p["x"] for p in points]
    closed = points[0]["arrival"].get("kind") == "closed"
    fig, ax = plt.subplots(figsize=(6, 4))
    has_slo = ms[0].get("goodput") is not None
    ax.plot(x, [m["request_throughput"] for m in ms], "o--", label="completed req/s")
    if has_slo:
        ax.plot(x, [m["goodput"] for m in ms], "o-", label="goodput req/s")
        ax2 = ax.twinx()
        ax2.plot(x, [m["goodput_ratio"] for m in ms], "s:", color="gray", label="goodput ratio")
        ax2.set(ylabel="good / submitted", ylim=(0, 1.05))
    ax.set(xlabel="concurrency" if closed else "offered request rate (req/s)", ylabel="req/s",
           title="goodput" if has_slo else "throughput (no --goodput SLO given)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return _save(fig, path)


def write_plots(points: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    if not points:
        return []
    return [
        latency_vs_throughput(points, out_dir / "latency_vs_throughput.png"),
        latency_cdfs(points, out_dir / "ttft_tpot_cdf.png"),
        goodput_vs_rate(points, out_dir / "goodput_vs_rate.png"),
    ]
