"""`duet bench autoscale --live`: the step trace on a real local cluster.

    duet bench autoscale --live [--config deploy/autoscaling.yaml] [--out DIR]

Deploys the config (its pools' autoscaling policies decide), then sends open-loop
Poisson traffic: quiet, 5x for the burst, quiet again. Every request is a streamed
completion of a fixed-length prompt (distinct token ids: no prefix-cache hit makes
the work smaller). Samples each pool's replicas every second from Serve. Prints the
summary and writes JSON and a PNG (load, replicas per pool, TTFT p90 over time).
Starts its own Ray cluster; run it alone.

On one machine more replicas share the same cores: the policy's decisions are real,
the capacity they buy is not (docs/autoscaling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import threading
import time
from pathlib import Path

import httpx

from cluster.config import load_config


def add_args(p: argparse.ArgumentParser) -> None:
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

        from cluster.serve_cli import APP_NAME

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


def summarize(requests: list[dict], samples: list[dict], slo, pools: list[str]) -> dict:
    def good(r):
        return r["ok"] and r["ttft_s"] * 1e3 <= slo.ttft_ms and (r["tpot_s"] is None or r["tpot_s"] * 1e3 <= slo.tpot_ms)

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


def plot(result: dict, path: Path) -> Path:
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


def main(argv: list[str] | None = None) -> int:
    """`--live`: this module's run; without it, the simulation (loadgen/autoscale_bench.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--live" not in argv:
        from loadgen.autoscale_bench import main as simulated

        return simulated(argv)
    return main_live([a for a in argv if a != "--live"])


def main_live(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="duet bench autoscale --live", description=__doc__)
    add_args(p)
    args = p.parse_args(argv)
    cfg = load_config(args.config, {"gateway.port": args.port})
    from cluster import serve_cli

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
        "summary": summarize(requests, sampler.rows, cfg.slo, pools),
        "timeline": timeline, "requests": requests,
    }
    print(json.dumps(result["summary"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "live_step.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {plot(result, out / 'live_step.png')} and {out / 'live_step.json'}")
    return 0
