"""`duet bench engine`: offline throughput of our engine against Hugging Face
transformers `generate` on the same weights and dtype, measured in the same run.

Points: decode at batch 1, 8 and 32 (output tokens/s over the whole generate call,
`prompt_len`-token prompts, `output_len` forced output tokens), and prefill tokens/s
for one 512-token prompt. Each figure is the median of `repeats` runs. On a CPU each
point is also given as a share of its ceiling, which this machine's memory bandwidth
and GEMM speed on the model's own shapes set, measured in the same run
(bench/machine_ceilings.py).

    duet bench engine [--dtype bfloat16] [--threads 2] [--batches 1 8 32] [--no-hf] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench.json_output import write_json
from bench.machine_ceilings import measure
from cluster.cli import add_engine_args
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.engine import Engine
from engine.quant import packs_weights
from engine.sampling_params import SamplingParams


@dataclass
class BenchPoint:
    name: str
    batch: int
    prompt_len: int
    output_len: int
    ours_tok_s: float
    hf_tok_s: float | None
    ratio: float | None
    ceiling_tok_s: float | None
    pct_of_ceiling: float | None
    ours_runs: list[float]
    hf_runs: list[float]


def bench_prompts(engine: Engine, batch: int, length: int) -> list[list[int]]:
    base = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog while the band plays on. " * 64)
    return [base[i : i + length] for i in range(batch)]


def _median_rate(fn, tokens: int, repeats: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(tokens / (time.perf_counter() - t0))
    return statistics.median(runs), runs


def _load_hf(engine: Engine):
    from transformers import AutoModelForCausalLM

    ck = engine.checkpoint
    if ck.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(ck.path.parent), gguf_file=ck.path.name, dtype=engine.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(ck.path), dtype=engine.dtype)
    return model.to(engine.device).eval()


def run(
    model: str = DEFAULT_MODEL,
    dtype: str = "auto",
    device: str = "auto",
    prompt_len: int = 32,
    output_len: int = 64,
    batches: tuple[int, ...] = (1, 8, 32),
    prefill_len: int = 512,
    repeats: int = 3,
    with_hf: bool = True,
    threads: int | None = None,
    weight_quant: str = "none",
    decode_attention: str = "auto",
    packed_weights: str = "auto",
) -> dict:
    if threads:
        torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model, dtype=dtype, device=device, max_num_batched_tokens=max(prefill_len, 2048),
                                 weight_quant=weight_quant, decode_attention=decode_attention,
                                 packed_weights=packed_weights))
    hf = _load_hf(engine) if with_hf else None
    dtype_name = str(engine.dtype).removeprefix("torch.")
    ceilings: dict[str, float] = {}
    measured = None
    if engine.device == "cpu":
        measured = measure(engine.model_config, engine.dtype, [*batches, prefill_len], weight_quant)
        ceilings = {f"decode_b{b}": measured.decode_tok_s(b) for b in batches}
        ceilings[f"prefill_{prefill_len}"] = measured.prefill_tok_s(prefill_len)
        print(f"  ceilings: flags {' '.join(measured.cpu_flags) or '-'}; read {measured.read_gbps:.1f} GB/s; "
              f"GEMM GFLOP/s by rows {', '.join(f'{r}: {g:.0f}' for r, g in measured.gemm_gflops.items())}",
              flush=True)
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    points: list[BenchPoint] = []

    def point(name, batch, plen, olen, ours_fn, hf_fn, tokens):
        ours_fn()  # warm-up
        ours, ours_runs = _median_rate(ours_fn, tokens, repeats)
        hf_rate, hf_runs = None, []
        if hf is not None:
            hf_fn()
            hf_rate, hf_runs = _median_rate(hf_fn, tokens, repeats)
        ceiling = ceilings.get(name)
        p = BenchPoint(
            name, batch, plen, olen, ours, hf_rate, ours / hf_rate if hf_rate else None,
            ceiling, 100 * ours / ceiling if ceiling else None, ours_runs, hf_runs,
        )
        points.append(p)
        print(f"  {name:12s} ours {ours:8.1f} tok/s   hf {hf_rate or 0:8.1f} tok/s", flush=True)

    for batch in batches:
        prompts = bench_prompts(engine, batch, prompt_len)

        def ours_fn(prompts=prompts):
            engine.generate(prompts, sp)

        def hf_fn(prompts=prompts):
            with torch.inference_mode():
                hf.generate(
                    torch.tensor(prompts, device=engine.device),
                    attention_mask=torch.ones(len(prompts), prompt_len, dtype=torch.long, device=engine.device),
                    max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                )

        point(f"decode_b{batch}", batch, prompt_len, output_len, ours_fn, hf_fn, batch * output_len)

    long_prompt = bench_prompts(engine, 1, prefill_len)[0]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.block_pool.enable_caching = False  # every run must compute the whole prompt

    def ours_prefill():
        engine.generate([long_prompt], one)

    def hf_prefill():
        with torch.inference_mode():
            hf(torch.tensor([long_prompt], device=engine.device))

    point(f"prefill_{prefill_len}", 1, prefill_len, 1, ours_prefill, hf_prefill, prefill_len)

    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": engine.device,
        },
        "model": engine.model_id,
        "dtype": dtype_name,
        "weight_quant": weight_quant,
        "decode_attention": "native" if engine.runner.decode_kernel is not None else "torch",
        "packed_weights": packs_weights(packed_weights, engine.device, engine.dtype, weight_quant),
        "ceilings": measured.as_dict() if measured else None,
        "repeats": repeats,
        "points": [asdict(p) for p in points],
    }


def print_table(result: dict) -> None:
    print(f"\nmodel {result['model']}  dtype {result['dtype']}  weights {result.get('weight_quant', 'none')}  "
          f"decode attention {result.get('decode_attention', 'torch')}  "
          f"packed weights {result.get('packed_weights', False)}  "
          f"device {result['machine']['device']}  threads {result['machine']['threads']}  "
          f"(median of {result['repeats']})")
    c = result.get("ceilings")
    if c:
        gemm = ", ".join(f"{r} rows {g:.0f}" for r, g in c["gemm_gflops"].items())
        print(f"CPU flags: {' '.join(c['cpu_flags']) or '-'}\nceilings measured in this run: memory read "
              f"{c['read_gbps']:.1f} GB/s, GEMM GFLOP/s on the model's shapes: {gemm}; "
              f"weights {c['weight_bytes'] / 1e6:.0f} MB")
    print(f"{'point':14s}{'batch':>6s}{'in':>6s}{'out':>6s}{'ours tok/s':>12s}{'HF tok/s':>10s}{'ratio':>7s}"
          f"{'ceiling':>9s}{'% ceil':>8s}")
    for p in result["points"]:
        hf = f"{p['hf_tok_s']:.1f}" if p["hf_tok_s"] else "-"
        ratio = f"{p['ratio']:.2f}" if p["ratio"] else "-"
        ceil = f"{p['ceiling_tok_s']:.0f}" if p["ceiling_tok_s"] else "-"
        pct = f"{p['pct_of_ceiling']:.0f}%" if p.get("pct_of_ceiling") else "-"
        print(f"{p['name']:14s}{p['batch']:6d}{p['prompt_len']:6d}{p['output_len']:6d}"
              f"{p['ours_tok_s']:12.1f}{hf:>10s}{ratio:>7s}{ceil:>9s}{pct:>8s}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet bench engine", description=__doc__.split("\n\n")[0])
    add_engine_args(p)  # the engine flags `duet generate` takes, defined once in cluster/cli.py
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = run(
        model=args.model, dtype=args.dtype, device=args.device, prompt_len=args.prompt_len, output_len=args.output_len,
        batches=tuple(args.batches), prefill_len=args.prefill_len, repeats=args.repeats,
        with_hf=not args.no_hf, threads=args.threads, weight_quant=args.weight_quant,
        decode_attention=args.decode_attention, packed_weights=args.packed_weights,
    )
    print_table(result)
    if args.json:
        write_json(args.json, result)
    return 0
