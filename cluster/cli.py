"""The `duet` command line: serve, cluster, generate, bench, plan."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PYTHONHASHSEED", "0")
# Ray prestarts plain workers for a job's first driver (two on a 4-CPU local cluster).
# Every duet actor carries the job's runtime env, so none of them ever runs there: each
# only cost its ~3 CPU s of start-up and then sat idle until Ray reaped it.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# `duet bench TARGET` -> the module that owns the target's flags and its
# `main(argv) -> int`; imported only when its target runs (most load torch).
BENCH_TARGETS: dict[str, str] = {
    "engine": "bench.engine",
    "serve": "bench.serve",
    "efficiency": "bench.efficiency",
    "kv": "bench.kv",
    "cluster": "bench.cluster",
    "routing": "bench.routing",
    "tracing": "bench.tracing",
    "autoscale": "bench.autoscale",
    "startup": "bench.startup",
    "structured": "bench.structured",
    "speculative": "bench.speculative",
    "disaggregation": "bench.disaggregation",
    "choices": "bench.choices",
    "move": "bench.move",
    "faults": "bench.faults",
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags of `duet generate`, which `duet bench engine` takes too."""
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (embedded), a .gguf file, or a HF directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--weight-quant", default="none", choices=["none", "int8"], help="int8: weight-only int8 (CPU)")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "native", "torch"],
                   help="native: the C++ paged decode kernel (CPU); torch: gather, then matmuls")
    p.add_argument("--packed-weights", default="auto", choices=["auto", "on", "off"],
                   help="fp32 CPU weights also pre-packed for oneDNN, used by multi-row products")


def cmd_generate(args) -> int:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.errors import InvalidRequest
    from engine.sampling_params import SamplingParams

    try:
        sp = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop or [],
        )
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                     weight_quant=args.weight_quant, decode_attention=args.decode_attention,
                                     packed_weights=args.packed_weights))
        prompt = args.prompt
        if not args.raw:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        for out in engine.stream(prompt, sp):
            sys.stdout.write(out.text)
            sys.stdout.flush()
    except InvalidRequest as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    return 0


def cmd_bench(bench: argparse.ArgumentParser, target: str | None, rest: list[str]) -> int:
    """Run `duet bench TARGET`: the target's module parses `rest` itself."""
    if target is None:
        if not {"-h", "--help"} & set(rest):
            bench.error("a target is required: " + " | ".join(BENCH_TARGETS))
        bench.print_help()
        return 0
    return importlib.import_module(BENCH_TARGETS[target]).main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="duet", description="Disaggregated prefill/decode LLM serving on Ray Serve")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate offline with the engine, streaming the text")
    g.add_argument("prompt")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")

    # No -h of its own: `duet bench TARGET --help` must reach the target's parser.
    b = sub.add_parser("bench", help="benchmarks: " + " | ".join(BENCH_TARGETS), add_help=False,
                       usage="duet bench TARGET [flags]",
                       description="Run one benchmark; `duet bench TARGET --help` lists its flags.")
    b.add_argument("target", nargs="?", choices=BENCH_TARGETS, metavar="TARGET",
                   help=" | ".join(BENCH_TARGETS))

    sub.add_parser("plan", help="capacity planner (see `duet plan --help`)", add_help=False)

    from cluster import nodes_cli, serve_cli

    serve_cli.add_parser(sub)
    nodes_cli.add_parser(sub)

    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(b, args.target, rest)
    if args.cmd == "plan":
        from loadgen.cli import plan_main

        return plan_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "generate":
        return cmd_generate(args)
    if args.cmd == "cluster":
        return nodes_cli.run(args)
    return serve_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
