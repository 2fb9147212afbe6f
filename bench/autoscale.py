"""`duet bench autoscale`: autoscaling policies through a burst, in two modes.

Simulated (the default, seconds):

    duet bench autoscale [--rate 0.4] [--queue-targets 2 4 8 16] [--seeds 0 1 2] [--out DIR]

compares `fixed`, Serve's queue rule at several targets and the goodput policy (its
own code, through loadgen/autoscale_sim.py) on a step burst (quiet -> 5x -> quiet)
and a diurnal ramp. Prints the table, writes `sim.json` and one PNG per trace (load,
replicas per pool, TTFT p90 over time for each policy).

Live (`--live`, minutes):

    duet bench autoscale --live [--config deploy/autoscaling.yaml] [--out DIR]

deploys the config (its pools' autoscaling policies decide), then sends open-loop
Poisson traffic: quiet, 5x for the burst, quiet again. Every request is a streamed
completion of a fixed-length prompt (distinct token ids: no prefix-cache hit makes
the work smaller). Samples each pool's replicas every second from Serve. Prints the
summary and writes `live_step.json` and a PNG (load, replicas per pool, TTFT p90
over time). Starts its own Ray cluster; run it alone. On one machine more replicas
share the same cores: the policy's decisions are real, the capacity they buy is not
(docs/autoscaling.md).

The two modes take different flags: `--live` picks the mode, and `--help` after it
lists that mode's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from autoscaling.config import BudgetConfig, CapacityProfile, PoolAutoscaling, SLOConfig
from loadgen.autoscale_sim import ClusterSim, SimPolicy, SimRun
from loadgen.cli import add_disaggregation_args, local_prefill
from loadgen.distributions import parse_length

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "deploy" / "profiles" / "smollm2-135m-cpu.json"
PLOTTED = ("fixed", "queue-2", "queue-8", "goodput")
LIVE = "--live"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if LIVE in argv:
        return main_live(live_parser().parse_args([a for a in argv if a != LIVE]))
    return main_simulated(sim_parser().parse_args(argv))


def _live_flag(p: argparse.ArgumentParser, text: str) -> None:
    """`--live` in both modes' help; `main` reads it before either parser runs."""
    p.add_argument(LIVE, action="store_true", help=text)


def sim_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet bench autoscale", description="autoscaling policies compared in "
                                "simulation on a step burst and a diurnal ramp (--live: on a real local cluster)")
    _live_flag(p, "run the step trace on a real local cluster instead (`--live --help`: its flags)")
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
    add_disaggregation_args(p)
    p.add_argument("--out", default="docs/bench/autoscale", help="directory for the JSON and PNGs")
    return p


def live_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet bench autoscale", description="the step trace on a real local "
                                "cluster: the config's autoscaling policies decide (without --live: in simulation)")
    _live_flag(p, "this mode; without it, the simulation")
    p.add_argument("--config", default="deploy/autoscaling.yaml")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--quiet-rate", type=float, default=0.15, help="requests/s outside the burst")
    p.add_argument("--burst", type=float, default=5.0, help="the burst's rate, times the quiet rate")
    p.add_argument("--quiet-s", type=float, default=60)
    p.add_argument("--burst-s", type=float, default=120)
    p.add_argument("--after-s", type=float, default=180)
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/bench/autoscale")
    return p


def traces(rate: float, burst: float = 5.0) -> dict[str, tuple]:
    """name -> (rate(t), duration_s, burst window or None)."""
    step = (120.0, 300.0)
    return {
        "step": (lambda t: rate * (burst if step[0] <= t < step[1] else 1.0), 600.0, step),
        "diurnal": (lambda t: rate * (1 + (burst - 1) * (1 - math.cos(2 * math.pi * t / 900.0)) / 2), 900.0, None),
    }


def run_simulated(args: argparse.Namespace) -> dict:
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
                 "disaggregation": args.disaggregation,
                 "seeds": args.seeds, "traces": {}}
    for name, (rate, duration, burst) in traces(args.rate).items():
        rows, timelines = [], {}
        for pol in policies:
            pools = {p: PoolAutoscaling(**common, target_ongoing_requests=pol.target_ongoing_requests)
                     for p in ("prefill", "decode")}
            runs: list[SimRun] = []
            for seed in args.seeds:
                sim = ClusterSim(profile, slo, pools, {"prefill": 1, "decode": 1}, parse_length(args.input_len),
                                 parse_length(args.output_len), cold_start_s=args.cold_start_s, budget=budget,
                                 seed=seed, local_prefill=local_prefill(args))
                runs.append(sim.run(pol, rate, duration))
            rows.append(_median_row([r.summary(slo, burst) for r in runs]))
            if pol.name in PLOTTED:  # the first seed's, for the plots
                timelines[pol.name] = [{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
                                       for row in runs[0].timeline]
        out["traces"][name] = {"duration_s": duration, "burst": burst, "results": rows, "timelines": timelines}
    return out


def _median_row(rows: list[dict]) -> dict:
    """The median over seeds of each number (recovery: None counts as never)."""
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
        lines.append(f"{'policy':<10} {'goodput':>8} {'TTFT p90 ms':>12} {'replica-s':>10} {'actions':>8} "
                     f"{'recovery s':>11}")
        for r in tr["results"]:
            rec = r.get("recovery_s", "-")
            rec = "never" if rec is None else rec
            lines.append(f"{r['policy']:<10} {r['goodput_ratio']:>8.3f} {r['ttft_p90_ms']:>12.0f} "
                         f"{r['replica_seconds']:>10.0f} {r['scaling_actions']:>8.0f} {rec!s:>11}")
    return "\n".join(lines)


def plot_simulated(result: dict, out_dir: Path, policies: tuple[str, ...] = PLOTTED) -> list[Path]:
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


def main_simulated(args: argparse.Namespace) -> int:
    result = run_simulated(args)
    print(table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in plot_simulated(result, out):
        print(f"wrote {path}")
    for tr in result["traces"].values():  # the JSON keeps every 5th second of the timelines
        tr["timelines"] = {k: v[::5] for k, v in tr["timelines"].items()}
    (out / "sim.json").write_text(json.dumps(result, default=float))
    print(f"wrote {out / 'sim.json'}")
    return 0


async def _one(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int, t0: float) -> dict:
    body = {"model": "smollm2-135m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.monotonic()
    first = last = None
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"t": start - t0, "ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if '"error"' in line:
                        return {"t": start - t0, "ok": False, "error": line[:200]}
                    now = time.monotonic()
                    first = first or now
                    last = now
                    chunks += 1
    except httpx.HTTPError as e:
        return {"t": start - t0, "ok": False, "error": repr(e)}
    tpot = (last - first) / (max_tokens - 1) if first and max_tokens > 1 else None
    return {"t": start - t0, "ok": first is not None, "ttft_s": first and first - start, "tpot_s": tpot}


async def _drive(url: str, rate, duration: float, prompt_tokens: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    t0 = time.monotonic()
    tasks = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        t = 0.0
        while True:
            t += rng.expovariate(max(rate(t), 1e-6))  # thinning-free: the rate is piecewise constant
            if t >= duration:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            ids = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
            tasks.append(asyncio.create_task(_one(client, url, ids, max_tokens, t0)))
        return list(await asyncio.gather(*tasks))


class ReplicaSampler:
    """Each pool's replica states from Serve, every second, on a thread."""

    def __init__(self, pools: list[str]) -> None:
        self.pools, self.rows, self._stop = pools, [], threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ray import serve

        from cluster.serve_config import APP_NAME

        while not self._stop.is_set():
            try:
                deps = serve.status().applications[APP_NAME].deployments
                row = {"t": round(time.monotonic() - self.t0, 1)}
                for p in self.pools:
                    states = deps[p].replica_states
                    row[f"{p}_running"] = states.get("RUNNING", 0)
                    row[f"{p}_replicas"] = sum(states.values())
                self.rows.append(row)
            except Exception:
                pass
            self._stop.wait(1.0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def summarize_live(requests: list[dict], samples: list[dict], slo, pools: list[str]) -> dict:
    def good(r):
        return (r["ok"] and r["ttft_s"] * 1e3 <= slo.ttft_ms
                and (r["tpot_s"] is None or r["tpot_s"] * 1e3 <= slo.tpot_ms))

    ttfts = sorted(r["ttft_s"] for r in requests if r["ok"])
    out = {
        "requests": len(requests),
        "errors": sum(not r["ok"] for r in requests),
        "goodput_ratio": round(sum(good(r) for r in requests) / max(1, len(requests)), 4),
        "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3, 1) if ttfts else None,
        "replica_seconds": {p: round(sum(s[f"{p}_replicas"] for s in samples), 1) for p in pools},
        "max_replicas": {p: max((s[f"{p}_replicas"] for s in samples), default=0) for p in pools},
        "scaling_actions": {p: sum(1 for a, b in zip(samples, samples[1:]) if a[f"{p}_replicas"] != b[f"{p}_replicas"])
                            for p in pools},
    }
    return out


def plot_live(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    tl = result["timeline"]
    t = [s["t"] for s in tl]
    axes[0].plot(t, [s["rate"] for s in tl], color="black")
    axes[0].set_ylabel("offered load (req/s)")
    for i, p in enumerate(result["pools"]):
        axes[1].step(t, [s[f"{p}_replicas"] for s in tl], where="post", color=f"C{i}", label=f"{p} (asked for)")
        axes[1].step(t, [s[f"{p}_running"] for s in tl], where="post", color=f"C{i}", linestyle=":",
                     label=f"{p} (running)")
    axes[1].set_ylabel("replicas")
    axes[1].legend(fontsize=8)
    reqs = result["requests"]
    xs, ys = [], []
    for s in tl:
        window = sorted(r["ttft_s"] for r in reqs if r["ok"] and s["t"] - 20 <= r["t"] + r["ttft_s"] <= s["t"])
        if window:
            xs.append(s["t"])
            ys.append(window[int(0.9 * (len(window) - 1))] * 1e3)
    axes[2].plot(xs, ys, color="C3", label="TTFT p90 (last 20 s)")
    axes[2].axhline(result["slo"]["ttft_ms"], color="red", linestyle=":", label="TTFT SLO")
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("time (s)")
    axes[2].legend(fontsize=8)
    fig.suptitle("goodput autoscaling, step trace on the local cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main_live(args: argparse.Namespace) -> int:
    # Imported here: the cluster's config loads torch, which the simulated mode never needs.
    from cluster import serve_cli
    from cluster.config import load_config

    cfg = load_config(args.config, {"gateway.port": args.port})
    pools = list(cfg.pools())
    quiet, burst_end = args.quiet_s, args.quiet_s + args.burst_s
    duration = burst_end + args.after_s
    rate = lambda t: args.quiet_rate * (args.burst if quiet <= t < burst_end else 1.0)  # noqa: E731
    url = serve_cli.start(cfg)
    try:
        with ReplicaSampler(pools) as sampler:
            requests = asyncio.run(_drive(url, rate, duration, args.prompt_tokens, args.max_tokens, args.seed))
            time.sleep(2)
        timeline = [{**s, "rate": rate(s["t"])} for s in sampler.rows]
    finally:
        serve_cli.stop()
    result = {
        "machine": platform.processor() or platform.machine(),
        "config": args.config, "slo": cfg.slo.model_dump(), "pools": pools,
        "trace": {"quiet_rate": args.quiet_rate, "burst": args.burst, "quiet_s": args.quiet_s,
                  "burst_s": args.burst_s, "after_s": args.after_s, "prompt_tokens": args.prompt_tokens,
                  "max_tokens": args.max_tokens},
        "summary": summarize_live(requests, sampler.rows, cfg.slo, pools),
        "timeline": timeline, "requests": requests,
    }
    print(json.dumps(result["summary"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "live_step.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {plot_live(result, out / 'live_step.png')} and {out / 'live_step.json'}")
    return 0
