"""`duet bench choices`: what `n` copies of one prompt cost when they arrive together.

    duet bench choices [--n 1 4 8] [--prompt-tokens 128] [--max-tokens 16] [--runs 3] [--json F]

The `n` choices of one request (and a burst of requests on one system prompt) reach
an engine together. Each point adds `n` sampled requests (seed + i, as the gateway's
choices are) with one prompt of `--prompt-tokens` random vocabulary tokens to an idle
in-process engine (`Engine` driven step by step, no HTTP) and runs them to the end,
two ways one after the other, their order alternating from run to run:

- **wait** (the scheduler's behaviour): a request whose prompt's leading blocks a
  running request is computing waits for them to be cached, then hits them;
- **compute**: the scheduler's wait turned off, so every copy computes the prompt.

Per way: prompt tokens computed (prompt tokens minus prefix-cache hits), TTFT of the
first and of the last choice, and the time until every choice has finished. Medians of
`--runs`; prints a table and writes JSON with the machine's CPU flags.
"""

from __future__ import annotations

import argparse
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


def point(engine: Engine, prompt: list[int], n: int, max_tokens: int, wait: bool) -> dict:
    """`n` copies of `prompt` (one no earlier point used, so nothing of it is cached)
    added at once to the idle `engine`, run to the end."""
    engine.scheduler.wait_for_shared_prefix = wait
    start = time.perf_counter()
    rids = [engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True))
            for i in range(n)]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench choices", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default="out/bench_choices.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    engine = Engine(EngineConfig(dtype=a.dtype, max_num_seqs=max(a.n), max_model_len=a.prompt_tokens + a.max_tokens))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def fresh_prompt() -> list[int]:  # a prompt no earlier point has cached
        return [rng.randrange(100, vocab) for _ in range(a.prompt_tokens)]

    point(engine, fresh_prompt()[:32], 2, 2, True)  # warm-up
    runs: dict[str, list[dict]] = {}
    for r in range(a.runs):
        for n in a.n:
            ways = ["wait", "compute"] if r % 2 == 0 else ["compute", "wait"]
            for way in ways:
                pt = point(engine, fresh_prompt(), n, a.max_tokens, way == "wait")
                runs.setdefault(f"{n}/{way}", []).append(pt)
            print(f"  run {r + 1} n={n}: " + ", ".join(
                f"{w} {runs[f'{n}/{w}'][-1]['all_done_ms']:.0f} ms" for w in ("wait", "compute")), flush=True)
    rows = []
    for key, pts in runs.items():
        n, way = key.split("/")
        rows.append({"n": int(n), "way": way, **{k: statistics.median(pt[k] for pt in pts) for k in pts[0]}})
    rows.sort(key=lambda row: (row["n"], row["way"] != "wait"))
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
