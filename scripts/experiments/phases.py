"""`scripts/experiments/phases.py`: where one request's time goes, disaggregated against aggregated.

Starts `duet serve` in each mode (alternating rounds, so drift on a shared machine
hits both alike) with every span exported to a sink in this process, and sends
requests one at a time (concurrency 1: nothing queues, so each phase is its own
cost). For each prompt length it reports the client's TTFT and end-to-end time and,
from the spans, the gateway's own TTFT (so what the Serve proxy's hops and the client
add is the difference), when each phase starts after the gateway's SERVER span
begins and how long it lasts: routing, the prefill replica's compute, the decode call's start
after prefill answered, the KV pull, decode's compute. Medians over all requests
of all rounds. This is the measurement behind "disaggregation costs nothing at c=1"
(docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run as a script

import argparse
import json
import os
import statistics
import time

import httpx

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from cluster import serve_cli
from cluster.config import load_config
from telemetry.otlp_sink import OTLPSink, ReceivedSpan

MODES = ("disaggregated", "aggregated")
# A request's spans as both modes name them; the gateway's SERVER span is the root.
_PHASES = ("route prefill", "prefill", "prefill.compute", "route decode", "decode", "kv_transfer", "decode.compute",
           "generate", "aggregated.compute")


def _one(url: str, model: str, words: int, output_len: int, index: int) -> tuple[str, float, float]:
    """One streamed chat request: (request id, client TTFT ms, client end-to-end ms)."""
    text = f"{index} " + " ".join(f"word{i}" for i in range(words))  # a distinct start: no prefix hit
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, rid = None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first, rid = time.perf_counter(), json.loads(line[6:])["id"]
    if first is None or rid is None:
        raise RuntimeError("the stream carried no chunk")
    return rid, (first - t0) * 1e3, (time.perf_counter() - t0) * 1e3


def _spans(sink: OTLPSink, rid: str, mode: str) -> list[ReceivedSpan]:
    """The request's spans once its root and the last phase of `mode` have arrived."""
    last = "decode.compute" if mode == "disaggregated" else "aggregated.compute"

    def complete() -> list[ReceivedSpan] | None:
        roots = sink.find(**{"duet.request_id": rid})
        got = sink.trace(roots[0].trace_id) if roots else []
        return got if last in {s.name for s in got} and any(s.parent_span_id is None for s in got) else None

    sink.wait_for(lambda: complete() is not None, 30)
    return complete() or []


def _round(mode: str, sink: OTLPSink, a) -> dict[int, list[dict]]:
    cfg = load_config(a.config, {"mode": mode, "gateway.port": a.port, "telemetry.tracing": True,
                                 "telemetry.otlp_endpoint": sink.endpoint, "telemetry.sample_ratio": 1.0,
                                 "telemetry.export_delay_ms": 200})
    url = serve_cli.start(cfg)
    try:
        out: dict[int, list[dict]] = {}
        for words in a.prompt_words:
            for i in range(a.warmup):
                _one(url, cfg.engine.model, words, a.output_len, -1 - i)
            rows = []
            for i in range(a.requests):
                rid, ttft, e2e = _one(url, cfg.engine.model, words, a.output_len, i)
                spans = _spans(sink, rid, mode)
                root = min(s.start_ns for s in spans) if spans else 0
                phases = {s.name: {"start_ms": (s.start_ns - root) / 1e6, "ms": s.duration_ms}
                          for s in spans if s.name in _PHASES}
                root_attrs = next((s.attributes for s in spans if s.parent_span_id is None), {})
                gateway_ttft = root_attrs.get("duet.ttft_ms")
                rows.append({"ttft_ms": ttft, "e2e_ms": e2e,
                             "prompt_tokens": root_attrs.get("gen_ai.usage.input_tokens"),
                             "gateway_ttft_ms": gateway_ttft,
                             # The Serve proxy's hops (in and out) and the client's own HTTP work.
                             "ttft_outside_gateway_ms": ttft - gateway_ttft if gateway_ttft is not None else None,
                             "phases": phases})
            out[words] = rows
        return out
    finally:
        serve_cli.stop()


def _median(rows: list[dict], *path: str) -> float | None:
    vals = []
    for r in rows:
        v = r
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, int | float):
            vals.append(v)
    return statistics.median(vals) if vals else None


def summarize(runs: dict[str, list[dict[int, list[dict]]]], prompt_words: list[int]) -> list[dict]:
    summary = []
    for words in prompt_words:
        for mode in MODES:
            rows = [r for rnd in runs[mode] for r in rnd[words]]
            summary.append({
                "prompt_words": words, "mode": mode, "requests": len(rows),
                "prompt_tokens": _median(rows, "prompt_tokens"),
                "ttft_ms": _median(rows, "ttft_ms"), "e2e_ms": _median(rows, "e2e_ms"),
                "gateway_ttft_ms": _median(rows, "gateway_ttft_ms"),
                "ttft_outside_gateway_ms": _median(rows, "ttft_outside_gateway_ms"),
                "phases": {p: {"start_ms": _median(rows, "phases", p, "start_ms"),
                               "ms": _median(rows, "phases", p, "ms")}
                           for p in _PHASES if _median(rows, "phases", p, "ms") is not None},
            })
    return summary


def table(summary: list[dict]) -> str:
    lines = []
    for s in summary:
        lines.append(f"{s['mode']:>13s}  prompt {s['prompt_tokens'] or '?'} tokens: client TTFT {s['ttft_ms']:.1f} ms, "
                     f"end-to-end {s['e2e_ms']:.1f} ms (median of {s['requests']})")
        if s["gateway_ttft_ms"] is not None:
            lines.append(f"{'':15s}TTFT inside the gateway {s['gateway_ttft_ms']:.1f} ms; outside it (Serve's proxy "
                         f"in and out, the client) {s['ttft_outside_gateway_ms']:.1f} ms")
        for name, p in s["phases"].items():
            lines.append(f"{'':15s}{name:20s} starts +{p['start_ms']:7.1f} ms, lasts {p['ms']:7.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/experiments/phases.py")
    p.add_argument("--json", default="out/bench_phases.json")
    p.add_argument("--config", default=None, help="cluster config file (default: the built-in defaults)")
    p.add_argument("--port", type=int, default=8073)
    # Many short rounds: this shared VM drifts by tens of percent within minutes.
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=5, help="per prompt length, per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-words", type=int, nargs="+", default=[5, 110])
    p.add_argument("--output-len", type=int, default=8)
    a = p.parse_args(argv)

    sink = OTLPSink()
    runs: dict[str, list[dict[int, list[dict]]]] = {m: [] for m in MODES}
    try:
        for r in range(a.rounds):
            for mode in MODES:
                runs[mode].append(_round(mode, sink, a))
                print(f"round {r + 1}/{a.rounds} {mode}: " + ", ".join(
                    f"{w} words TTFT {_median(rows, 'ttft_ms'):.0f} ms" for w, rows in runs[mode][-1].items()),
                    flush=True)
    finally:
        sink.close()
    summary = summarize(runs, a.prompt_words)
    print(table(summary))
    result = {"machine": {"cpus": os.cpu_count(), "cpu_flags": cpu_flags()},
              "load": {"prompt_words": a.prompt_words, "output_len": a.output_len, "concurrency": 1, "stream": True},
              "rounds": a.rounds, "summary": summary,
              "runs": {m: [{str(w): rows for w, rows in rnd.items()} for rnd in rounds] for m, rounds in runs.items()}}
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
