"""`duet bench structured`: what structured outputs cost the engine.

    duet bench structured [--concurrency 1 32] [--requests-per-slot 2] [--runs 3] [--json F]

The workload is chat prompts that each ask for one of three JSON schemas (nested
objects, enums, arrays, bounded integers and strings). At each closed-loop
concurrency, the same prompts run two ways, one after the other on one in-process
engine (greedy, one `Engine` driven directly, no HTTP):

1. **constrained**: with the schema as the request's structured output;
2. **free**: without it, each forced (`ignore_eos`) to exactly the length its
   constrained answer had.

So both ways make the same tokens from the same prompts. The ratio of their output
tok/s is the grammar's cost: one bitmask per constrained row per step, filled on the
engine thread, then applied to the logits.

**compile**: the time to build a request's matcher, with its first mask. *cold*: a
schema never seen (its grammar text built, then compiled); *cached*: a schema seen
before (its grammar text reused; the matcher is still built per request). AsyncEngine
does this on a worker thread, so it adds to a structured request's TTFT, never to
other requests' steps.

Medians of `--runs`. Prints a table and writes JSON with the machine's CPU flags.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from bench.closed_loop import closed_loop
from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput

SCHEMAS: dict[str, dict] = {
    "employee": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 18, "maximum": 70},
            "role": {"enum": ["engineer", "designer", "manager"]},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "age", "role", "address"], "additionalProperties": False,
    },
    "shopping": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"product": {"type": "string", "maxLength": 12},
                                             "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["product", "quantity"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "sentiment": {"enum": ["positive", "neutral", "negative"]},
                       "recommend": {"type": "boolean"}, "summary": {"type": "string", "maxLength": 24}},
        "required": ["stars", "sentiment", "recommend", "summary"], "additionalProperties": False,
    },
}
ASKS = {"employee": "Invent an employee of a small company.", "shopping": "Write a short shopping list.",
        "review": "Review a restaurant you liked."}
MAX_TOKENS = 200


def prompts(engine: Engine, n: int) -> list[tuple[list[int], str]]:
    """`n` (prompt ids, schema name), cycling through the schemas."""
    out = []
    for i in range(n):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{ASKS[name]} Answer in JSON. (#{i})"}])
        out.append((engine.tokenizer.encode(text), name))
    return out


def point(engine: Engine, concurrency: int, n: int) -> dict:
    work = prompts(engine, n)
    constrained = [(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                        structured=StructuredOutput.json_schema(SCHEMAS[name])))
                   for ids, name in work]
    c = closed_loop(engine, constrained, concurrency)
    free = [(ids, SamplingParams(max_tokens=max(1, length), temperature=0, ignore_eos=True))
            for (ids, _), length in zip(work, c["lengths"])]
    f = closed_loop(engine, free, concurrency)
    for run in (c, f):
        del run["tokens"]
    return {"concurrency": concurrency, "requests": n, "constrained": c, "free": f,
            "ratio": c["output_tok_s"] / f["output_tok_s"]}


def compile_times(engine: Engine, runs: int) -> dict:
    """Milliseconds to build a matcher and fill its first mask: cold and cached schemas."""
    bitmask = torch.full((1, (engine.model_config.vocab_size + 31) // 32), -1, dtype=torch.int32)
    cold, cached = [], []
    for i in range(runs * 5):
        schema = json.loads(json.dumps(SCHEMAS["employee"]))
        schema["properties"][f"note_{time.perf_counter_ns()}_{i}"] = {"type": "string"}  # never seen
        for bucket, spec in ((cold, StructuredOutput.json_schema(schema)),
                             (cached, StructuredOutput.json_schema(SCHEMAS["employee"]))):
            t = time.perf_counter()
            engine.grammars.matcher(spec, []).fill_bitmask(bitmask, 0)
            bucket.append(1000 * (time.perf_counter() - t))
    return {"cold_ms": statistics.median(cold), "cached_ms": statistics.median(cached)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests per point = concurrency x this (>= 6)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default="out/bench_structured.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    engine = Engine(EngineConfig(dtype=a.dtype, max_num_seqs=max(a.concurrency)))
    engine.grammars.matcher(StructuredOutput("json_object"), [])  # the tokenizer's llguidance view, once
    closed_loop(engine, [(ids, SamplingParams(max_tokens=4)) for ids, _ in prompts(engine, 2)], 2)  # warm-up
    runs: dict[int, list[dict]] = {c: [] for c in a.concurrency}
    for r in range(a.runs):
        for c in a.concurrency:
            runs[c].append(point(engine, c, max(6, c * a.requests_per_slot)))
            print(f"  run {r + 1} c={c}: ratio {runs[c][-1]['ratio']:.3f}", flush=True)
    compile_ms = compile_times(engine, a.runs)
    rows = []
    for c, pts in runs.items():
        med = {way: statistics.median(pt[way]["output_tok_s"] for pt in pts) for way in ("constrained", "free")}
        rows.append({"concurrency": c, "constrained_tok_s": med["constrained"], "free_tok_s": med["free"],
                     "ratio": statistics.median(pt["ratio"] for pt in pts),
                     "ttft_p50_ms_constrained": statistics.median(pt["constrained"]["ttft_p50_ms"] for pt in pts),
                     "ttft_p50_ms_free": statistics.median(pt["free"]["ttft_p50_ms"] for pt in pts)})
    print("| conc | constrained tok/s | free tok/s | ratio | TTFT p50 constrained / free ms |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['concurrency']} | {row['constrained_tok_s']:.1f} | {row['free_tok_s']:.1f} | "
              f"{row['ratio']:.3f} | {row['ttft_p50_ms_constrained']:.0f} / {row['ttft_p50_ms_free']:.0f} |")
    print(f"matcher build + first mask: cold schema {compile_ms['cold_ms']:.2f} ms, "
          f"cached {compile_ms['cached_ms']:.2f} ms")
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                          "torch": torch.__version__, "threads": a.threads, "dtype": str(engine.dtype)},
              "rows": rows, "compile": compile_ms, "runs": {str(c): pts for c, pts in runs.items()}}
    write_json(a.json, report)
    return 0
