"""`duet bench disaggregation`: always vs never vs auto (`router.disaggregation`).

One `duet serve` (1 prefill + 1 decode replica) per mode, one after another on the same
cores; against each, the same workloads at the same open-loop rates, driven by
`duet bench serve` (loadgen) in its own process:

- **short**: short chat, 64 prompt tokens / 128 output tokens;
- **long**: long prompts, 1,024 / 64;
- **multi-turn**: 3-turn sessions of 64-token turns (each turn's prompt carries the
  conversation so far), 64 output tokens a turn.

`always` is today's path (every prompt through the prefill pool), `never` prefills every
prompt on the decode replica (aggregated routing of the same two replicas), and `auto`
prices each pass in both places (autoscaling/placement.py), computing at most
`max_local_prompt_tokens` tokens locally. Each point reports goodput (requests/s meeting the
TTFT and TPOT SLOs), TTFT and TPOT p50/p90 and output tokens/s; the table also gives
auto's goodput against the better of the other two at each point.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import torch

from bench.json_output import write_json
from bench.loadgen_subprocess import run_loadgen
from bench.machine_ceilings import cpu_flags
from cluster import serve_cli
from cluster.config import load_config

MODES = ("always", "never", "auto")
# name -> loadgen arguments (besides rates, prompts and seed).
WORKLOADS: dict[str, list[str]] = {
    "short": ["--workload", "random", "--input-len", "64", "--output-len", "128", "--endpoint", "completions"],
    "long": ["--workload", "random", "--input-len", "1024", "--output-len", "64", "--endpoint", "completions"],
    "multi-turn": ["--workload", "multi-turn", "--turns", "3", "--input-len", "64", "--output-len", "64",
                   "--endpoint", "chat"],
}
# Open-loop rates (req/s) per workload: light, near what 2 cores serve, past it.
RATES: dict[str, list[float]] = {"short": [0.1, 0.25, 0.5], "long": [0.1, 0.2, 0.4], "multi-turn": [0.2, 0.4, 0.8]}


def row(point: dict) -> dict:
    m = point["metrics"]
    return {
        "rate": point.get("x"),
        "completed": m["completed"],
        "failed": m["failed"],
        "goodput_rps": m.get("goodput"),
        "goodput_ratio": m.get("goodput_ratio"),
        "ttft_p50_ms": m["ttft_ms"]["median"],
        "ttft_p90_ms": m["ttft_ms"]["p90"],
        "tpot_p50_ms": m["tpot_ms"]["median"],
        "tpot_p90_ms": m["tpot_ms"]["p90"],
        "output_tok_s": m["output_throughput"],
    }


def serve_mode(mode: str, workloads: list[str], rates: dict[str, list[float]], num_prompts: int, slo: list[str],
               local_max: int, port: int) -> dict[str, list[dict]]:
    cfg = load_config(overrides={"mode": "disaggregated", "gateway.port": port,
                                 "router.disaggregation": {"mode": mode, "max_local_prompt_tokens": local_max}})
    url = serve_cli.start(cfg)
    out: dict[str, list[dict]] = {}
    try:
        for i, name in enumerate(workloads):
            with tempfile.TemporaryDirectory() as d:
                points = run_loadgen(url, Path(d), [
                    *WORKLOADS[name], "--num-prompts", str(num_prompts), "--seed", str(100 + i), "--ignore-eos",
                    "--warmup", "2", "--goodput", *slo, "--request-rate", *(str(r) for r in rates[name])])
            out[name] = [row(p) for p in points]
            for r in out[name]:
                print(f"  {mode} {name} rate {r['rate']}: goodput {r['goodput_rps']:.3f} req/s, "
                      f"TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms", flush=True)
    finally:
        serve_cli.stop()
    return out


def table(result: dict) -> str:
    lines = ["| workload | rate | mode | goodput req/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | out tok/s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    verdicts = []
    modes = [m for m in MODES if m in result["modes"]]
    for name in result["workloads"]:
        for i, rate in enumerate(result["rates"][name]):
            by_mode = {m: result["modes"][m][name][i] for m in modes}
            for m, r in by_mode.items():
                lines.append(f"| {name} | {rate:g} | {m} | {r['goodput_rps']:.3f} | {r['ttft_p50_ms']:.0f} / "
                             f"{r['ttft_p90_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} | "
                             f"{r['output_tok_s']:.1f} |")
            if {"always", "never", "auto"} <= by_mode.keys():
                best = max(by_mode["always"]["goodput_rps"], by_mode["never"]["goodput_rps"])
                verdicts.append(f"{name} @ {rate:g} req/s: auto {by_mode['auto']['goodput_rps']:.3f} vs best of "
                                f"the others {best:.3f} ({by_mode['auto']['goodput_rps'] - best:+.3f})")
    return "\n".join(lines + [""] + verdicts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench disaggregation", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--num-prompts", type=int, default=16, help="requests per point")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every rate (a slower or faster machine)")
    p.add_argument("--slo", nargs="+", default=["ttft:2000", "tpot:200"], metavar="KEY:MS",
                   help="goodput SLOs (the cluster config's default SLO)")
    p.add_argument("--max-local-prompt-tokens", type=int, default=256, help="auto's local limit")
    p.add_argument("--port", type=int, default=8072)
    p.add_argument("--json", default="out/bench_disaggregation.json")
    a = p.parse_args(argv)
    rates = {w: [r * a.rate_scale for r in RATES[w]] for w in a.workloads}
    result: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                    "torch": torch.__version__},
        "workloads": a.workloads, "rates": rates, "num_prompts": a.num_prompts, "slo": a.slo,
        "max_local_prompt_tokens": a.max_local_prompt_tokens, "modes": {},
    }
    for mode in a.modes:
        print(mode, flush=True)
        result["modes"][mode] = serve_mode(mode, a.workloads, rates, a.num_prompts, a.slo,
                                           a.max_local_prompt_tokens, a.port)
    print(table(result))
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
