"""`duet bench tracing`: what tracing costs the serving path.

Starts `duet serve` (disaggregated, 1 prefill + 1 decode) with tracing off, then
with tracing on at sampling 1.0 exporting every span over OTLP/HTTP to a sink in
this process (telemetry/otlp_sink.py: it decodes every batch, as a collector
would), in alternating rounds so drift on a shared machine hits both alike. Each
round drives the same closed-loop load (`duet bench serve`) at each concurrency;
the figures are medians over rounds, and the span count proves the "on" rounds
really exported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import httpx

from bench.json_output import write_json
from bench.loadgen_subprocess import run_loadgen, summarize
from bench.machine_ceilings import cpu_flags
from cluster import serve_cli
from cluster.config import load_config
from telemetry.otlp_sink import OTLPSink, render_tree


def one_trace(url: str, sink: OTLPSink, output_len: int) -> str:
    """The span tree of one streamed chat request on an idle cluster."""
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    rid = json.loads(events[0])["id"]

    def spans():
        roots = sink.find(**{"duet.request_id": rid})
        got = sink.trace(roots[0].trace_id) if roots else []
        return got if {"kv_transfer", "decode.compute", "prefill.compute"} <= {s.name for s in got} and any(
            s.parent_span_id is None for s in got) else None

    sink.wait_for(lambda: spans() is not None, 30)
    return render_tree(spans() or [])


def _round(tracing: bool, sink: OTLPSink, a, tree: list[str]) -> list[dict]:
    overrides: dict = {"gateway.port": a.port}
    if tracing:
        overrides |= {"telemetry.tracing": True, "telemetry.otlp_endpoint": sink.endpoint,
                      "telemetry.sample_ratio": 1.0}
    url = serve_cli.start(load_config(a.config, overrides))
    try:
        if tracing and not tree:
            tree.append(one_trace(url, sink, a.output_len))
            print(tree[0], flush=True)
        rows = []
        for c in a.concurrency:
            with tempfile.TemporaryDirectory() as d:
                point = run_loadgen(
                    url, Path(d),
                    ["--concurrency", str(c), "--num-prompts", str(max(a.num_prompts, c)), "--input-len",
                     str(a.input_len), "--output-len", str(a.output_len), "--ignore-eos", "--warmup", "2"],
                )[0]
            rows.append(dict(summarize(point), concurrency=c))
        return rows
    finally:
        serve_cli.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench tracing")
    p.add_argument("--json", default="out/bench_tracing.json")
    p.add_argument("--config", default=None, help="cluster config file (default: the built-in defaults)")
    p.add_argument("--port", type=int, default=8072)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    a = p.parse_args(argv)

    sink = OTLPSink()
    runs: dict[str, list[list[dict]]] = {"off": [], "on": []}
    tree: list[str] = []
    spans_per_round = []
    try:
        for r in range(a.rounds):
            for mode in ("off", "on"):
                before = len(sink.spans)
                runs[mode].append(_round(mode == "on", sink, a, tree))
                if mode == "on":
                    spans_per_round.append(len(sink.spans) - before)
                print(f"round {r + 1}/{a.rounds} tracing {mode}: " + ", ".join(
                    f"c={row['concurrency']} {row['output_tok_s']:.1f} tok/s TTFT p50 {row['ttft_p50_ms']:.0f} ms"
                    for row in runs[mode][-1]), flush=True)
    finally:
        sink.close()

    summary = []
    for i, c in enumerate(a.concurrency):
        med = {mode: {k: statistics.median(run[i][k] for run in rounds)
                      for k in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")}
               for mode, rounds in runs.items()}
        summary.append({
            "concurrency": c,
            "off": med["off"],
            "on": med["on"],
            "tok_s_change": med["on"]["output_tok_s"] / med["off"]["output_tok_s"] - 1,
            "ttft_change": med["on"]["ttft_p50_ms"] / med["off"]["ttft_p50_ms"] - 1,
        })
    result = {
        "machine": {"cpus": os.cpu_count(), "cpu_flags": cpu_flags()},
        "load": {"input_len": a.input_len, "output_len": a.output_len, "num_prompts": a.num_prompts, "stream": True},
        "rounds": a.rounds,
        "spans_exported_per_on_round": spans_per_round,
        "span_tree": tree[0] if tree else None,
        "runs": runs,
        "summary": summary,
    }
    print(f"\n{'conc':>4s}{'tok/s off':>11s}{'tok/s on':>10s}{'change':>8s}"
          f"{'TTFT off':>10s}{'TTFT on':>9s}{'change':>8s}")
    for s in summary:
        print(f"{s['concurrency']:4d}{s['off']['output_tok_s']:11.1f}{s['on']['output_tok_s']:10.1f}"
              f"{s['tok_s_change']:8.1%}{s['off']['ttft_p50_ms']:10.0f}{s['on']['ttft_p50_ms']:9.0f}{s['ttft_change']:8.1%}")
    print(f"spans exported per traced round: {spans_per_round}")
    write_json(a.json, result)
    return 0
