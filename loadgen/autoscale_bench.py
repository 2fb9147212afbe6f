"""`duet bench autoscale`: autoscaling policies compared in simulation on a step
burst (quiet -> 5x -> quiet) and a diurnal ramp, with the goodput policy's own code
(loadgen/autoscale_sim.py). Prints the table, writes JSON and one PNG per trace
(load, replicas per pool, TTFT p90 over time for each policy)."""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

from autoscaling.config import BudgetConfig, CapacityProfile, PoolAutoscaling, SLOConfig
from loadgen.autoscale_sim import ClusterSim, SimPolicy, SimRun
from loadgen.distributions import parse_length

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "deploy" / "profiles" / "smollm2-135m-cpu.json"


PLOTTED = ("fixed", "queue-2", "queue-8", "goodput")


def traces(rate: float, burst: float = 5.0) -> dict[str, tuple]:
    """name -> (rate(t), duration_s, burst window or None)."""
    step = (120.0, 300.0)
    return {
        "step": (lambda t: rate * (burst if step[0] <= t < step[1] else 1.0), 600.0, step),
        "diurnal": (lambda t: rate * (1 + (burst - 1) * (1 - math.cos(2 * math.pi * t / 900.0)) / 2), 900.0, None),
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="capacity profile (a `duet plan` JSON)")
    p.add_argument("--rate", type=float, default=0.4, help="quiet request rate (req/s); the burst is 5x")
    p.add_argument("--input-len", default="uniform:128:512")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--ttft-ms", type=float, default=2000)
    p.add_argument("--tpot-ms", type=float, default=200)
    p.add_argument("--cold-start-s", type=float, default=20, help="a new replica's start-up (model load)")
    p.add_argument("--max-replicas", type=int, default=8)
    p.add_argument("--queue-targets", type=float, nargs="+", default=[2, 4, 8, 16],
                   help="Serve's target_ongoing_requests values to compare (2 is Serve's default)")
    p.add_argument("--budget-cpus", type=float, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="docs/bench/autoscale", help="directory for the JSON and PNGs")


def run(args) -> dict:
    profile = CapacityProfile.load(args.profile)
    slo = SLOConfig(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)
    common = dict(min_replicas=1, max_replicas=args.max_replicas, max_step=2, upscale_delay_s=5,
                  downscale_delay_s=30, warmup_s=10)
    policies = [SimPolicy("fixed", "fixed")]
    policies += [SimPolicy(f"queue-{t:g}", "queue", t) for t in args.queue_targets]
    policies.append(SimPolicy("goodput", "goodput"))
    budget = BudgetConfig(cpus=args.budget_cpus) if args.budget_cpus else None
    out: dict = {"machine": platform.processor() or platform.machine(), "profile": profile.model_dump(),
                 "slo": slo.model_dump(), "settings": common, "cold_start_s": args.cold_start_s,
                 "quiet_rate": args.rate, "input_len": args.input_len, "output_len": args.output_len,
                 "seeds": args.seeds, "traces": {}}
    for name, (rate, duration, burst) in traces(args.rate).items():
        rows, timelines = [], {}
        for pol in policies:
            pools = {p: PoolAutoscaling(**common, target_ongoing_requests=pol.target_ongoing_requests)
                     for p in ("prefill", "decode")}
            runs: list[SimRun] = []
            for seed in args.seeds:
                sim = ClusterSim(profile, slo, pools, {"prefill": 1, "decode": 1}, parse_length(args.input_len),
                                 parse_length(args.output_len), cold_start_s=args.cold_start_s, budget=budget, seed=seed)
                runs.append(sim.run(pol, rate, duration))
            rows.append(_median_row([r.summary(slo, burst) for r in runs]))
            if pol.name in PLOTTED:  # the first seed's, for the plots
                timelines[pol.name] = [{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
                                       for row in runs[0].timeline]
        out["traces"][name] = {"duration_s": duration, "burst": burst, "results": rows, "timelines": timelines}
    return out


def _median_row(rows: list[dict]) -> dict:
    """The median over seeds of each number (recovery: None counts as never)."""
    import statistics

    row = dict(rows[0])
    for k in ("goodput_ratio", "ttft_p90_ms", "replica_seconds", "scaling_actions"):
        row[k] = round(statistics.median(r[k] for r in rows), 4)
    if "recovery_s" in row:
        rec = [math.inf if r["recovery_s"] is None else r["recovery_s"] for r in rows]
        m = statistics.median(rec)
        row["recovery_s"] = None if math.isinf(m) else m
    row["runs"] = len(rows)
    return row


def table(result: dict) -> str:
    lines = []
    for name, tr in result["traces"].items():
        lines.append(f"\n{name} trace ({tr['duration_s']:.0f} s), median of {len(result['seeds'])} seeds")
        lines.append(f"{'policy':<10} {'goodput':>8} {'TTFT p90 ms':>12} {'replica-s':>10} {'actions':>8} {'recovery s':>11}")
        for r in tr["results"]:
            rec = r.get("recovery_s", "-")
            rec = "never" if rec is None else rec
            lines.append(f"{r['policy']:<10} {r['goodput_ratio']:>8.3f} {r['ttft_p90_ms']:>12.0f} "
                         f"{r['replica_seconds']:>10.0f} {r['scaling_actions']:>8.0f} {rec!s:>11}")
    return "\n".join(lines)


def plot(result: dict, out_dir: Path, policies: tuple[str, ...] = PLOTTED) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, tr in result["traces"].items():
        fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
        shown = [p for p in policies if p in tr["timelines"]]
        first = tr["timelines"][shown[0]]
        axes[0].plot([r["t"] for r in first], [r["rate"] for r in first], color="black")
        axes[0].set_ylabel("offered load (req/s)")
        for i, pol in enumerate(shown):
            tl = tr["timelines"][pol]
            t = [r["t"] for r in tl]
            color = f"C{i}"
            axes[1].step(t, [r["prefill_replicas"] for r in tl], where="post", color=color, label=f"{pol} prefill")
            axes[1].step(t, [r["decode_replicas"] for r in tl], where="post", color=color, linestyle="--",
                         label=f"{pol} decode")
            axes[2].plot(t, [r["ttft_p90_ms"] if r["ttft_p90_ms"] is not None else float("nan") for r in tl],
                         color=color, label=pol)
        axes[1].set_ylabel("replicas (solid prefill, dashed decode)")
        axes[1].legend(fontsize=7, ncol=4)
        axes[2].axhline(result["slo"]["ttft_ms"], color="red", linestyle=":", label="TTFT SLO")
        axes[2].set_yscale("log")
        axes[2].set_ylabel("TTFT p90, last 20 s (ms)")
        axes[2].set_xlabel("time (s)")
        axes[2].legend(fontsize=7)
        fig.suptitle(f"autoscaling policies, {name} trace (simulated)")
        fig.tight_layout()
        path = out_dir / f"sim_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench autoscale", description=__doc__)
    add_args(p)
    args = p.parse_args(argv)
    result = run(args)
    print(table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in plot(result, out):
        print(f"wrote {path}")
    for tr in result["traces"].values():  # the JSON keeps every 5th second of the timelines
        tr["timelines"] = {k: v[::5] for k, v in tr["timelines"].items()}
    (out / "sim.json").write_text(json.dumps(result, default=float))
    print(f"wrote {out / 'sim.json'}")
    return 0
