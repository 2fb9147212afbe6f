"""`duet bench speculative`: what speculative decoding gains, and costs.

    duet bench speculative [--concurrency 1 8] [--requests 4] [--runs 3] [--json F]
                           [--method ngram|draft] [--model M] [--draft-model D]

Three workloads, each run two ways one after the other on in-process engines that
share one set of weights (`Engine` driven directly, no HTTP):

- **extractive**: chat prompts that hand the model a text and ask for it back word for
  word. Each text is the embedded model's own greedy answer to a question, so the
  answer copies long spans of the prompt: the case prompt lookup is for.
- **random**: prompts of random vocabulary tokens with forced-length greedy answers
  (`ignore_eos`). The small model's greedy
  continuation of noise soon loops, and a loop is what prompt lookup drafts best.
- **sampled**: the same prompts sampled at temperature 1 (seeded): the output rarely
  repeats, so drafts are few and mostly rejected, and the gate turns them off. This
  is the cost of looking and of the rows that fail. (Seeded outputs are reproducible
  but not the same draws with speculation, so no identity check here.)

**off** runs the engine without speculation; **on** with `engine.speculative.method:
ngram`, or `draft` with `--draft-model` (default: the embedded model, so that a model
drafting for itself measures the mechanism's cost with every draft accepted), the
other settings at their defaults unless given; their order alternates
from run to run. The ratio of their output tok/s is the gain. Greedy outputs must be
identical both ways; the benchmark checks it on every request and says so. Medians of
`--runs`; prints a table and writes JSON with the machine's CPU flags and the
acceptance figures.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics

import torch

from bench.closed_loop import closed_loop
from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

QUESTIONS = (
    "Explain how a steam engine works.",
    "Describe the water cycle.",
    "What makes a good night's sleep?",
    "How do bees make honey?",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
)
TEXT_TOKENS = 128  # the length of each text to copy
OUTPUT_TOKENS = 128
RANDOM_PROMPT_TOKENS = 128


def extractive_prompts(engine: Engine, n: int) -> list[list[int]]:
    """`n` prompts that each ask for the model's own answer to a question back."""
    tok = engine.tokenizer
    asks = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(n)]
    texts = engine.generate(asks, SamplingParams(max_tokens=TEXT_TOKENS, temperature=0))
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content":
            f"Here is a text:\n\n{t.text.strip()}\n\nRepeat the text above exactly, word for word."}]))
            for t in texts]


def random_prompts(engine: Engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    return [[rng.randrange(100, vocab) for _ in range(RANDOM_PROMPT_TOKENS)] for _ in range(n)]


def point(off: Engine, on: Engine, work: list[tuple[list[int], SamplingParams]], concurrency: int,
          on_first: bool) -> dict:
    before = (on.num_draft_tokens, on.num_accepted_tokens, on.num_verify_steps)
    if on_first:
        spec = closed_loop(on, work, concurrency)
        base = closed_loop(off, work, concurrency)
    else:
        base = closed_loop(off, work, concurrency)
        spec = closed_loop(on, work, concurrency)
    drafted, accepted, verified = (now - then for now, then in
                                   zip((on.num_draft_tokens, on.num_accepted_tokens, on.num_verify_steps), before))
    same = base.pop("tokens") == spec.pop("tokens")
    identical = same if all(sp.greedy for _, sp in work) else None
    return {"off": base, "on": spec, "ratio": spec["output_tok_s"] / base["output_tok_s"], "identical": identical,
            "draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": verified,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_verify_step": (accepted + verified) / verified if verified else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=4, help="requests per point and workload (at least the concurrency)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-tokens", type=int, default=None, help="engine.speculative.num_tokens (default: its default)")
    p.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target checkpoint (engine.model)")
    p.add_argument("--draft-model", default=DEFAULT_MODEL, help="method draft: the draft checkpoint")
    p.add_argument("--json", default="out/bench_speculative.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = EngineConfig(model=a.model, dtype=a.dtype, max_num_seqs=max(a.concurrency))
    off = Engine(cfg)
    spec = {"method": a.method, **({"draft_model": a.draft_model} if a.method == "draft" else {}),
            **({"num_tokens": a.num_tokens} if a.num_tokens else {})}
    on = Engine(cfg.replace(speculative=spec), model=off.model)
    n = max(a.requests, max(a.concurrency))
    noise = random_prompts(off, n)
    workloads = {
        "extractive": [(ids, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0))
                       for ids in extractive_prompts(off, n)],
        "random": [(ids, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)) for ids in noise],
        "sampled": [(ids, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=1.0, seed=i, ignore_eos=True))
                    for i, ids in enumerate(noise)],
    }
    for engine in (off, on):  # warm-up
        closed_loop(engine, [(ids, SamplingParams(max_tokens=4)) for ids in noise[:2]], 2)
    runs: dict[str, list[dict]] = {}
    for r in range(a.runs):
        for name, work in workloads.items():
            for c in a.concurrency:
                pt = point(off, on, work[: max(a.requests, c)], c, on_first=r % 2 == 1)
                runs.setdefault(f"{name}/{c}", []).append(pt)
                print(f"  run {r + 1} {name} c={c}: ratio {pt['ratio']:.3f} acceptance "
                      f"{pt['acceptance'] if pt['acceptance'] is None else round(pt['acceptance'], 3)} "
                      f"identical {pt['identical']}", flush=True)
    rows = []
    for key, pts in runs.items():
        name, c = key.split("/")
        accept = [pt["acceptance"] for pt in pts if pt["acceptance"] is not None]
        per_step = [pt["tokens_per_verify_step"] for pt in pts if pt["tokens_per_verify_step"] is not None]
        rows.append({"workload": name, "concurrency": int(c),
                     "off_tok_s": statistics.median(pt["off"]["output_tok_s"] for pt in pts),
                     "on_tok_s": statistics.median(pt["on"]["output_tok_s"] for pt in pts),
                     "ratio": statistics.median(pt["ratio"] for pt in pts),
                     "acceptance": statistics.median(accept) if accept else None,
                     "tokens_per_verify_step": statistics.median(per_step) if per_step else None,
                     "identical": None if pts[0]["identical"] is None else all(pt["identical"] for pt in pts)})
    print("| workload | conc | off tok/s | on tok/s | ratio | acceptance | tokens per verify step | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        per = "-" if row["tokens_per_verify_step"] is None else f"{row['tokens_per_verify_step']:.2f}"
        print(f"| {row['workload']} | {row['concurrency']} | {row['off_tok_s']:.1f} | {row['on_tok_s']:.1f} | "
              f"{row['ratio']:.3f} | {acc} | {per} | {'-' if row['identical'] is None else row['identical']} |")
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                          "torch": torch.__version__, "threads": a.threads, "dtype": str(off.dtype)},
              "speculative": on.cfg.speculative.model_dump(), "rows": rows, "runs": runs}
    write_json(a.json, report)
    return 0 if all(row["identical"] is not False for row in rows) else 1
