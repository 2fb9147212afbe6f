"""`duet bench cluster`: the issue-3 figures on this machine, in one run.

1. Disaggregated (1 prefill + 1 decode) against aggregated (1 pool), same cores:
   TTFT / TPOT p50 and p99 and output tokens/s at several closed-loop
   concurrencies, measured by `duet bench serve` (loadgen) against `duet serve`.
2. Handoff cost per request for several prompt lengths and both transfer
   backends: KV bytes and transfer seconds as decode's own counters report them
   (the real in-cluster pull), GB/s, and their share of the request's TTFT.
3. Gateway overhead: TTFT over HTTP at concurrency 1 against the engine's own
   in-process TTFT for the same prompt length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.json_output import write_json
from bench.loadgen_subprocess import run_loadgen, summarize
from cluster import serve_cli
from cluster.config import load_config


def pool_stats(url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("duet_pool_stat{"):
            labels, value = line[len("duet_pool_stat{") :].rsplit("} ", 1)
            kv = dict(p.split("=", 1) for p in labels.split(","))
            key = (kv["pool"].strip('"'), kv["stat"].strip('"'))
            out[key] = out.get(key, 0.0) + float(value)
    return out


def bench_modes(concurrency: list[int], num_prompts: int, input_len: int, output_len: int, port: int) -> dict:
    results = {}
    for mode in ("aggregated", "disaggregated"):
        # Same hardware: the one aggregated replica gets the threads of both pools.
        cfg = load_config(overrides={"mode": mode, "gateway.port": port})
        cfg.aggregated.threads = cfg.prefill.threads + cfg.decode.threads
        cfg.aggregated.num_cpus = cfg.prefill.num_cpus + cfg.decode.num_cpus
        url = serve_cli.start(cfg)
        try:
            with tempfile.TemporaryDirectory() as d:
                points = run_loadgen(
                    url, Path(d),
                    ["--concurrency", *map(str, concurrency), "--num-prompts", str(num_prompts),
                     "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos", "--warmup", "2"],
                )
            results[mode] = [dict(summarize(p), concurrency=c) for p, c in zip(points, concurrency)]
        finally:
            serve_cli.stop()
    return results


def bench_handoff(prompt_lens: list[int], requests: int, port: int) -> dict:
    results = {}
    for backend in ("nixl", "torch"):
        cfg = load_config(
            overrides={"transfer.backend": backend, "gateway.port": port, "engine.max_model_len": 4096,
                       "engine.enable_prefix_caching": False}
        )
        url = serve_cli.start(cfg)
        rows = []
        try:
            for n in prompt_lens:
                before = pool_stats(url)
                with tempfile.TemporaryDirectory() as d:
                    point = run_loadgen(
                        url, Path(d),
                        ["--concurrency", "1", "--num-prompts", str(requests), "--input-len", str(n),
                         "--output-len", "4", "--ignore-eos", "--warmup", "1"],
                    )[0]
                after = pool_stats(url)
                d_bytes = after[("decode", "transfer_bytes")] - before[("decode", "transfer_bytes")]
                d_secs = after[("decode", "transfer_seconds")] - before[("decode", "transfer_seconds")]
                d_count = after[("decode", "transfer_count")] - before[("decode", "transfer_count")]
                ttft = point["metrics"]["ttft_ms"]["median"]
                per_ms = 1000 * d_secs / max(d_count, 1)
                rows.append({
                    "prompt_tokens": n,
                    "transfers": d_count,
                    "bytes_per_request": d_bytes / max(d_count, 1),
                    "transfer_ms": per_ms,
                    "gb_s": (d_bytes / d_secs / 1e9) if d_secs else None,
                    "ttft_p50_ms": ttft,
                    "share_of_ttft": per_ms / ttft if ttft else None,
                })
        finally:
            serve_cli.stop()
        results[backend] = rows
    return results


def engine_ttft(prompt_len: int, repeats: int = 5) -> float:
    """The engine's own TTFT (ms, median) in-process: no HTTP, no Serve, no handoff."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    eng = Engine(EngineConfig(enable_prefix_caching=False))
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200)[:prompt_len]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        next(iter(eng.stream(ids, sp)))
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench cluster")
    p.add_argument("--json", default="out/bench_cluster.json")
    p.add_argument("--port", type=int, default=8071)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--handoff-lens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--handoff-requests", type=int, default=5)
    p.add_argument("--skip", nargs="*", default=[], choices=["modes", "handoff", "gateway"])
    a = p.parse_args(argv)
    result: dict = {"machine": {"cpus": os.cpu_count()}}
    if "gateway" not in a.skip:
        result["engine_ttft_ms"] = {"prompt_tokens": a.input_len, "median_ms": engine_ttft(a.input_len)}
        print(f"engine TTFT ({a.input_len} tokens, in-process): {result['engine_ttft_ms']['median_ms']:.1f} ms")
    if "modes" not in a.skip:
        result["modes"] = bench_modes(a.concurrency, a.num_prompts, a.input_len, a.output_len, a.port)
        print(f"\n{'mode':15s}{'conc':>5s}{'TTFT p50':>10s}{'TTFT p99':>10s}"
              f"{'TPOT p50':>10s}{'TPOT p99':>10s}{'out tok/s':>11s}")
        for mode, rows in result["modes"].items():
            for r in rows:
                print(f"{mode:15s}{r['concurrency']:5d}{r['ttft_p50_ms']:10.1f}{r['ttft_p99_ms']:10.1f}"
                      f"{r['tpot_p50_ms']:10.1f}{r['tpot_p99_ms']:10.1f}{r['output_tok_s']:11.1f}")
    if "handoff" not in a.skip:
        result["handoff"] = bench_handoff(a.handoff_lens, a.handoff_requests, a.port)
        print(f"\n{'backend':8s}{'tokens':>7s}{'MB/req':>8s}{'xfer ms':>9s}{'GB/s':>7s}{'TTFT ms':>9s}{'share':>7s}")
        for backend, rows in result["handoff"].items():
            for r in rows:
                print(f"{backend:8s}{r['prompt_tokens']:7d}{r['bytes_per_request'] / 1e6:8.2f}{r['transfer_ms']:9.2f}"
                      f"{(r['gb_s'] or 0):7.2f}{r['ttft_p50_ms']:9.1f}{(r['share_of_ttft'] or 0):7.1%}")
    write_json(a.json, result)
    return 0
