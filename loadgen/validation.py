"""`plan --validate`: run a scaled-down version of a plan against a live server and
compare the simulator's prediction with what the server does.

The local cluster has fewer replicas than the plan, so the target rate is scaled by
the smaller of the two replica ratios; the prediction simulates the local replica
counts at that rate. Errors are reported, never asserted: timings on a shared
machine are noisy.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from loadgen.arrivals import ArrivalProcess
from loadgen.bench import BenchConfig, run_sweep
from loadgen.planner import Plan, PlanTarget
from loadgen.simulator import simulate
from loadgen.tokenizer import TokenizerLike
from loadgen.workloads import WorkloadSpec

COMPARED = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "goodput_ratio")


@dataclass(frozen=True)
class ValidationSetup:
    """The live server and the scaled-down run's size."""

    base_url: str
    model: str | None
    endpoint: str = "completions"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    num_prompts: int = 50
    rate: float | None = None  # default: scaled from the target
    seed: int = 0
    timeout_s: float = 300.0
    warmup: int = 2


def scaled_rate(plan: Plan, target: PlanTarget, setup: ValidationSetup) -> float:
    ratio = min(setup.prefill_replicas / plan.prefill_replicas, setup.decode_replicas / plan.decode_replicas, 1.0)
    return target.traffic.rate * ratio


def measured_summary(point: dict[str, Any]) -> dict[str, float]:
    m = point["metrics"]
    out = {}
    for name in ("ttft", "tpot", "e2el"):
        for stat in ("p50", "p90", "p99", "mean"):
            v = m[f"{name}_ms"].get(stat)
            out[f"{name}_{stat}_ms"] = math.nan if v is None else v
    out["goodput_ratio"] = m.get("goodput_ratio") or 0.0
    out["goodput_rps"] = m.get("goodput") or 0.0
    return out


def validate(plan: Plan, target: PlanTarget, setup: ValidationSetup, tokenizer: TokenizerLike,
             progress: bool = True) -> dict[str, Any]:
    rate = setup.rate or scaled_rate(plan, target, setup)
    tr = target.traffic
    scaled = type(tr)(rate, tr.input_len, tr.output_len, tr.burstiness)
    predicted = simulate(plan.prefill_model, plan.decode_model, setup.prefill_replicas, setup.decode_replicas,
                         scaled, max(setup.num_prompts, 1000), setup.seed, plan.transfer_s,
                         plan.local_prefill).summary(target.slo)
    workload = WorkloadSpec("random", setup.num_prompts, tr.input_len, tr.output_len, setup.seed, ignore_eos=True)
    cfg = BenchConfig(setup.base_url, setup.model, setup.endpoint, workload,
                      [ArrivalProcess(rate=rate, burstiness=tr.burstiness, seed=setup.seed)],
                      target.slo, setup.warmup, setup.timeout_s, progress=progress)
    point = asyncio.run(run_sweep(cfg, tokenizer))[0]
    measured = measured_summary(point)
    rows = []
    for k in COMPARED:
        p, m = predicted.get(k, math.nan), measured.get(k, math.nan)
        err = (p - m) / m if m and not math.isnan(m) and not math.isnan(p) else math.nan
        rows.append({"metric": k, "predicted": p, "measured": m, "rel_error": err})
    return {"rate": rate, "prefill_replicas": setup.prefill_replicas, "decode_replicas": setup.decode_replicas,
            "num_prompts": setup.num_prompts, "comparison": rows, "measured_point": point}


def format_comparison(result: dict[str, Any]) -> str:
    lines = [f"validation at {result['rate']:.3g} req/s on {result['prefill_replicas']} prefill + "
             f"{result['decode_replicas']} decode replicas, {result['num_prompts']} requests",
             f"{'metric':<16}{'predicted':>12}{'measured':>12}{'error':>9}"]
    for r in result["comparison"]:
        err = "–" if math.isnan(r["rel_error"]) else f"{r['rel_error']:+.0%}"
        lines.append(f"{r['metric']:<16}{r['predicted']:>12.3f}{r['measured']:>12.3f}{err:>9}")
    return "\n".join(lines)
