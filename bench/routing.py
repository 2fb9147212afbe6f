"""Routing and KV-tier benchmark: two prefill replicas, two workloads, three setups.

    duet bench routing [--out bench_routing.json] [--quick]

Setups: Serve's default routing (power of two choices), the KV-aware router, and
the KV-aware router with an LMCache CPU tier in each prefill replica. Workloads:
*shared system prompt* (one long system prompt, short distinct user turns) and
*multi-turn chat* (sessions whose every turn resends the whole conversation, with
``x-session-id``). Per run: TTFT p50/p90 (first streamed token at the client),
prefill tokens computed per request (prompt − cached), hit rates of the block
pool and of the tier, and requests per prefill replica. Prints a table, writes JSON.

The prefill pools are kept small (`--kv-blocks`), so a replica cannot hold every
conversation: that is where routing and the tier matter. Starts its own Ray
cluster; run it alone (`flock /tmp/duet-ray.lock`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

SETUPS = {
    "default-routing": {"router": {"policy": "default"}},
    "kv-aware": {"router": {"policy": "kv_aware"}},
    "kv-aware+lmcache": {"router": {"policy": "kv_aware"}, "cache": {"cpu_bytes": 512 << 20, "chunk_size": 64}},
}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def shared_system_prompt(n: int, seed: int = 0) -> list[list[tuple[str | None, list[int]]]]:
    """One wave per request: the same 384-token system prompt + 48 distinct tokens."""
    rng = random.Random(seed)
    system = _ids(rng, 384)
    return [[(None, system + _ids(rng, 48))] for _ in range(n)]


def multi_turn(sessions: int, turns: int, seed: int = 1) -> list[list[tuple[str | None, list[int]]]]:
    """Wave t holds turn t of every session; turn t resends turns < t plus 64 new tokens
    (the model's replies stand in as 16 fixed tokens per turn)."""
    rng = random.Random(seed)
    convs = [_ids(rng, 160) for _ in range(sessions)]
    waves = []
    for _ in range(turns):
        wave = []
        for s in range(sessions):
            convs[s] = convs[s] + _ids(rng, 64)
            wave.append((f"session-{s}", list(convs[s])))
            convs[s] = convs[s] + _ids(rng, 16)
        waves.append(wave)
    return waves


async def _one(client: httpx.AsyncClient, url: str, session: str | None, ids: list[int]) -> dict:
    body = {"model": "smollm2-135m", "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-session-id": session} if session else {}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if ttft is None and msg.get("choices"):
                ttft = time.perf_counter() - t0
            if msg.get("usage"):
                usage = msg["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "prompt": (usage or {}).get("prompt_tokens", len(ids)), "cached": cached}


async def _run_waves(url: str, waves, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=300) as client:

        async def go(session, ids):
            async with sem:
                out.append(await _one(client, url, session, ids))

        for wave in waves:
            await asyncio.gather(*(go(s, ids) for s, ids in wave))
    return out


async def _replica_stats(n: int) -> dict[str, dict]:
    from ray import serve

    h = serve.get_deployment_handle("prefill", "duet")
    seen: dict[str, dict] = {}
    for _ in range(50):
        s = await h.stats.remote()
        seen[s["replica_id"]] = s
        if len(seen) == n:
            break
    return seen


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(results: list[dict], before: dict, after: dict) -> dict:
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)

    def delta(key):
        return {rid: after[rid].get(key, 0) - before.get(rid, {}).get(key, 0) for rid in after}

    per_replica = delta("leases_granted")
    tier_hits = sum(delta("kv_tier_cpu_hit_tokens").values())
    return {
        "requests": len(results),
        "ttft_p50_ms": 1000 * _pct(ttfts, 0.5),
        "ttft_p90_ms": 1000 * _pct(ttfts, 0.9),
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "prefill_tokens_per_request": (prompt - cached) / len(results),
        "prompt_tokens_per_request": prompt / len(results),
        "cached_hit_rate": cached / prompt if prompt else 0.0,
        "tier_cpu_hit_rate": tier_hits / prompt if prompt else 0.0,
        "pool_hit_rate": (cached - tier_hits) / prompt if prompt else 0.0,
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
    }


def _config(setup: dict, kv_blocks: int, port: int) -> dict:
    cfg = {
        "engine": {"dtype": "auto", "max_model_len": 2048, "num_kv_blocks": kv_blocks, "max_num_batched_tokens": 512},
        "prefill": {"replicas": 2, "num_cpus": 0.25, "threads": 1},
        # Only the prefill pool is squeezed: a small decode pool would reject handoffs.
        "decode": {"replicas": 1, "num_cpus": 0.25, "threads": 1, "num_kv_blocks": 512},
        "transfer": {"backend": "torch"},
        "gateway": {"port": port, "num_cpus": 0.1},
    }
    for k, v in setup.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duet bench routing", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_routing.json")
    ap.add_argument("--kv-blocks", type=int, default=96, help="KV blocks per prefill replica (small: forces evictions)")
    ap.add_argument("--requests", type=int, default=24, help="shared-system-prompt requests")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--setups", default=",".join(SETUPS))
    args = ap.parse_args(argv)

    import logging
    import os

    import ray
    from ray import serve

    from cluster.app import REPLICA_ENV, SERVE_ENV, build_app
    from cluster.config import ClusterConfig
    from cluster.serve_cli import wait_ready

    os.environ.update({k: v for k, v in REPLICA_ENV.items() if k not in SERVE_ENV})  # this driver calls handles
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": REPLICA_ENV})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    workloads = {
        "shared-system-prompt": shared_system_prompt(args.requests),
        "multi-turn-chat": multi_turn(args.sessions, args.turns),
    }
    report: dict = {"args": vars(args), "runs": []}
    try:
        for name in args.setups.split(","):
            for wname, waves in workloads.items():
                # A fresh deployment per run: empty pools and tiers, same start for everyone.
                serve.delete("duet")
                cfg = ClusterConfig.model_validate(_config(SETUPS[name], args.kv_blocks, args.port))
                serve.run(build_app(cfg), name="duet", route_prefix="/", blocking=False)
                wait_ready(url, 300)
                asyncio.run(_run_waves(url, [[(None, _ids(random.Random(99), 32))]], 1))  # warm the path
                before = asyncio.run(_replica_stats(2))
                t0 = time.perf_counter()
                results = asyncio.run(_run_waves(url, waves, args.concurrency))
                wall = time.perf_counter() - t0
                after = asyncio.run(_replica_stats(2))
                row = {"setup": name, "workload": wname, "wall_s": wall, **_summary(results, before, after)}
                report["runs"].append(row)
                print(_fmt(row), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print()
    print(table(report["runs"]))
    print(f"\nwrote {args.out}")
    return 0


def _fmt(r: dict) -> str:
    return (f"{r['setup']:<18} {r['workload']:<21} ttft p50 {r['ttft_p50_ms']:7.0f} ms  "
            f"p90 {r['ttft_p90_ms']:7.0f} ms  "
            f"prefill tok/req {r['prefill_tokens_per_request']:6.0f}  hit {r['cached_hit_rate']:.2f} "
            f"(pool {r['pool_hit_rate']:.2f}, cpu tier {r['tier_cpu_hit_rate']:.2f})  "
            f"per replica {r['requests_per_replica']}")


def table(runs: list[dict]) -> str:
    head = ("| setup | workload | TTFT p50 (ms) | TTFT p90 (ms) | prefill tokens/req | prompt tokens/req | "
            "hit rate (pool / CPU tier) | requests per replica |")
    lines = [head, "|" + "---|" * 8]
    for r in runs:
        lines.append(
            f"| {r['setup']} | {r['workload']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['prefill_tokens_per_request']:.0f} | {r['prompt_tokens_per_request']:.0f} | "
            f"{r['pool_hit_rate']:.2f} / {r['tier_cpu_hit_rate']:.2f} | {r['requests_per_replica']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
