"""`duet bench choices`: what `n` copies of one prompt cost when they arrive together.

    duet bench choices [--n 1 4 8] [--prompt-tokens 128] [--max-tokens 16] [--runs 3] [--json F]

The `n` choices of one request (and a burst of requests on one system prompt) reach
an engine together. Each point adds `n` sampled requests (seed + i, as the gateway's
choices are) with one prompt of `--prompt-tokens` random vocabulary tokens to an idle
in-process engine (`Engine` driven step by step, no HTTP) and runs them to the end,
three ways one after the other, their order rotating from run to run:

- **fork** (what the gateway asks for the `n` choices of one request): the choices
  after the first name it in `fork_of`, wait until it has computed the prompt, then
  share its blocks and copy the last one (each computes its last prompt token again);
- **wait** (independent requests on one prompt): a request whose prompt's leading
  blocks a running request is computing waits for them to be cached, then hits them
  (each computes the last, partly filled block);
- **compute**: the scheduler's wait turned off, so every copy computes the prompt.

Per way: prompt tokens computed (prompt tokens minus prefix-cache hits), TTFT of the
first and of the last choice, and the time until every choice has finished. Medians of
`--runs`; prints a table and writes JSON with the machine's CPU flags.

With `--served`, the same question through `duet serve --mode disaggregated` (1 prefill
+ 1 decode replica, this machine's cores): per point, one streamed completion with `n`
choices (the gateway forks them on the decode replica) against `n` streamed
completions of the same prompt sent at once (seed + i each: each its own prefill,
lease and transfer, as every choice was before forking). Per way: TTFT of the first
and the last choice, all done, and the prefill leases granted, KV bytes transferred
and forks counted, from the pools' stats.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time

import torch

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

WAYS = ("fork", "wait", "compute")


def point(engine: Engine, prompt: list[int], n: int, max_tokens: int, way: str) -> dict:
    """`n` copies of `prompt` (one no earlier point used, so nothing of it is cached)
    added at once to the idle `engine`, run to the end."""
    engine.scheduler.wait_for_shared_prefix = way != "compute"
    start = time.perf_counter()
    rids: list[str] = []
    for i in range(n):
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        fork_of = rids[0] if rids and way == "fork" else None
        rids.append(engine.add_request(prompt, sp, fork_of=fork_of))
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            cached[out.request_id] = out.num_cached_tokens
    done = time.perf_counter() - start
    engine.scheduler.wait_for_shared_prefix = True
    ttfts = sorted(first[r] for r in rids)
    return {"computed_prompt_tokens": sum(len(prompt) - cached[r] for r in rids),
            "ttft_first_ms": ttfts[0] * 1e3, "ttft_last_ms": ttfts[-1] * 1e3, "all_done_ms": done * 1e3}


SERVED_WAYS = ("n choices", "n requests")


def served(a: argparse.Namespace) -> int:
    """The choices through `duet serve` (disaggregated); see the module docstring."""
    from bench.cluster import pool_stats
    from cluster import serve_cli
    from cluster.config import load_config
    from engine.weights import served_model_name

    cfg = load_config(overrides={"mode": "disaggregated", "gateway.port": a.port, "engine.dtype": a.dtype,
                                 "engine.max_model_len": a.prompt_tokens + a.max_tokens + 16})
    url = serve_cli.start(cfg)
    model = served_model_name(cfg.engine)
    rng = random.Random(0)
    vocab = 49152  # SmolLM2's; only ids below it are sent
    runs: dict[str, list[dict]] = {}
    try:
        asyncio.run(_stream(url, model, [rng.randrange(100, vocab) for _ in range(32)], 2, 2, True))  # warm-up
        for r in range(a.runs):
            for n in [n for n in a.n if n > 1]:
                for way in SERVED_WAYS if r % 2 == 0 else SERVED_WAYS[::-1]:
                    prompt = [rng.randrange(100, vocab) for _ in range(a.prompt_tokens)]
                    before = pool_stats(url)
                    pt = asyncio.run(_stream(url, model, prompt, n, a.max_tokens, way == "n choices"))
                    after = pool_stats(url)
                    pt.update({k: after.get(key, 0) - before.get(key, 0) for k, key in _COUNTED.items()})
                    runs.setdefault(f"{n}/{way}", []).append(pt)
                print(f"  run {r + 1} n={n}: " + ", ".join(
                    f"{w} {runs[f'{n}/{w}'][-1]['all_done_ms']:.0f} ms" for w in SERVED_WAYS), flush=True)
    finally:
        serve_cli.stop()
    rows = _median_rows(runs, SERVED_WAYS)
    print("| n | way | TTFT first ms | TTFT last ms | all done ms | prefill leases | KV MB moved | forks |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['n']} | {row['way']} | {row['ttft_first_ms']:.0f} | {row['ttft_last_ms']:.0f} | "
              f"{row['all_done_ms']:.0f} | {row['leases']:.0f} | {row['kv_bytes'] / 1e6:.1f} | {row['forks']:.0f} |")
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
                       "torch": torch.__version__},
           "config": vars(a), "rows": rows, "runs": runs}
    write_json(a.json, out)
    return 0


# Per way, from the pools' stats: prefill leases granted, KV bytes pulled, forks.
_COUNTED = {"leases": ("prefill", "leases_granted"), "kv_bytes": ("decode", "transfer_bytes"),
            "forks": ("decode", "num_forks")}


def _median_rows(runs: dict[str, list[dict]], ways: tuple[str, ...]) -> list[dict]:
    """One row per "n/way" key: the median of each figure over its runs, by n then way."""
    rows = []
    for key, pts in runs.items():
        n, way = key.split("/")
        rows.append({"n": int(n), "way": way, **{k: statistics.median(pt[k] for pt in pts) for k in pts[0]}})
    return sorted(rows, key=lambda row: (row["n"], ways.index(row["way"])))


async def _stream(url: str, model: str, prompt: list[int], n: int, max_tokens: int, one_request: bool) -> dict:
    """One request with `n` choices, or `n` requests at once (seed + i); TTFT of the
    first and last choice and the time until all are done, in ms."""
    import json

    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    firsts: list[float] = []
    start = time.perf_counter()

    async def one(client: httpx.AsyncClient, extra: dict) -> None:
        seen: set[int] = set()
        async with client.stream("POST", f"{url}/v1/completions", json={**body, **extra}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("text") and c["index"] not in seen:
                        seen.add(c["index"])
                        firsts.append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=600) as client:
        if one_request:
            await one(client, {"n": n, "seed": 0})
        else:
            await asyncio.gather(*(one(client, {"seed": i}) for i in range(n)))
    done = time.perf_counter() - start
    firsts.sort()
    return {"ttft_first_ms": firsts[0] * 1e3, "ttft_last_ms": firsts[-1] * 1e3, "all_done_ms": done * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench choices", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default="out/bench_choices.json")
    p.add_argument("--served", action="store_true", help="through duet serve (disaggregated) instead")
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args(argv)
    if a.served:
        return served(a)
    torch.set_num_threads(a.threads)
    engine = Engine(EngineConfig(dtype=a.dtype, max_num_seqs=max(a.n), max_model_len=a.prompt_tokens + a.max_tokens))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def fresh_prompt() -> list[int]:  # a prompt no earlier point has cached
        return [rng.randrange(100, vocab) for _ in range(a.prompt_tokens)]

    point(engine, fresh_prompt()[:32], 2, 2, "fork")  # warm-up
    runs: dict[str, list[dict]] = {}
    for r in range(a.runs):
        for n in a.n:
            for way in WAYS[r % 3:] + WAYS[:r % 3]:
                pt = point(engine, fresh_prompt(), n, a.max_tokens, way)
                runs.setdefault(f"{n}/{way}", []).append(pt)
            print(f"  run {r + 1} n={n}: " + ", ".join(
                f"{w} {runs[f'{n}/{w}'][-1]['all_done_ms']:.0f} ms" for w in WAYS), flush=True)
    rows = _median_rows(runs, WAYS)
    print("| n | way | prompt tokens computed | TTFT first ms | TTFT last ms | all done ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['n']} | {row['way']} | {row['computed_prompt_tokens']:.0f} | {row['ttft_first_ms']:.0f} | "
              f"{row['ttft_last_ms']:.0f} | {row['all_done_ms']:.0f} |")
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
                       "threads": a.threads, "torch": torch.__version__},
           "config": vars(a), "rows": rows, "runs": runs}
    write_json(a.json, out)
    return 0
