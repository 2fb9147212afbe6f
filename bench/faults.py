"""`duet bench faults`: what one fault costs a serving cluster, fault by fault.

One cluster of 1 prefill + 1 decode replica (the `duet serve` default; the prefix index
and the KV tier in a private Redis) serves a closed loop of chat requests (loadgen's
chaos soak: half streamed, all greedy and checked against a reference pass, each
exactly `--max-tokens` long). First a run without faults gives the baseline latency;
then, one run each, a single fault fires once a quarter of that run's requests have
ended:

- the decode replica's or the prefill replica's **engine core child** is SIGKILLed
  (the replica starts a new one in place);
- the **prefill replica's actor** is killed (Serve replaces it; decode prefills
  locally meanwhile);
- **KV transfers fail** for a few seconds (every lease the prefill replica grants
  expires at once, so each pull fails as a lost transfer would; decode recomputes);
- **Redis** stops for a few seconds and starts again;
- the **decode replica's actor**, which is the HTTP ingress, is killed: the streams and
  requests its connections carried die with it (no server can finish a response over
  a connection that is gone); what arrives after waits for its replacement.

Between runs the cluster is left to come back (both pools serving again). The table
gives each run's requests, failures, and the worst latency of any request against the
baseline's median: the latency one fault added. It is printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from cluster import faults, serve_cli
from cluster.config import load_config
from cluster.serve_config import APP_NAME
from loadgen.chaos import ChaosSoak, Fault, SoakPlan

REDIS_SH = Path(__file__).resolve().parents[1] / "scripts" / "redis.sh"


@dataclass(frozen=True)
class Case:
    name: str
    action: Callable[[], object]


def _one(pool: str) -> str:
    live = sorted(faults.live_replicas(pool))
    if not live:
        raise RuntimeError(f"no live {pool} replica")
    return live[0]


def _redis(cmd: str, port: int) -> None:
    env = dict(os.environ, DUET_REDIS_PORT=str(port), DUET_REDIS_DIR=f"/tmp/duet-redis-faults-{port}")
    subprocess.run(["bash", str(REDIS_SH), cmd], check=True, env=env, stdout=subprocess.DEVNULL)


def cases(redis_port: int | None, outage_s: float) -> list[Case]:
    out = [
        Case("decode engine core killed", lambda: faults.kill_engine_core(_one("decode"))),
        Case("prefill engine core killed", lambda: faults.kill_engine_core(_one("prefill"))),
        Case("prefill replica actor killed", lambda: faults.kill_replica(_one("prefill"))),
        Case(f"KV transfers fail for {outage_s:g} s", lambda: faults.fail_transfers(_one("prefill"), outage_s)),
    ]
    if redis_port is not None:
        def outage() -> None:
            _redis("stop", redis_port)
            time.sleep(outage_s)
            _redis("start", redis_port)

        out.append(Case(f"Redis down for {outage_s:g} s", outage))
    out.append(Case("decode replica actor (the ingress) killed", lambda: faults.kill_replica(_one("decode"))))
    return out


def _serving(url: str, timeout_s: float) -> None:
    """Both pools back: a replica of each alive, serving, and a request answered."""
    import httpx
    from ray import serve

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ok = all(serve.get_deployment_handle(p, APP_NAME).stats.remote().result(timeout_s=10)
                     .get("engine_serving", 1) for p in ("prefill", "decode"))
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            if ok and r.status_code == 200:
                return
        except Exception:  # noqa: BLE001 - a replica still starting; try again until the deadline
            pass
        time.sleep(1)
    raise TimeoutError(f"the cluster did not come back within {timeout_s:.0f} s")


def soak(url: str, plan: SoakPlan, fault: Case | None) -> dict:
    fired = [Fault(fault.name, plan.num_requests // 4, fault.action)] if fault else []
    runner = ChaosSoak(url, plan, fired)

    async def go():
        try:
            return await runner.run()
        finally:
            await runner.close()

    report = asyncio.run(go())
    seconds = [r.seconds for r in runner.results if r.outcome == "completed"]
    failures = [{"index": r.index, "stream": r.stream, "status": r.status, "error": (r.error or "")[:200]}
                for r in runner.results if r.outcome in ("failed", "hung")]
    return {
        "fault": fault.name if fault else None,
        "fault_error": report.faults[0].error if report.faults else None,
        "requests": len(runner.results),
        "completed": report.outcomes.get("completed", 0),
        "failed": report.outcomes.get("failed", 0),
        "hung": report.outcomes.get("hung", 0),
        "greedy_mismatches": report.greedy_mismatches,
        "wrong_lengths": report.wrong_lengths,
        "latency_p50_s": statistics.median(seconds) if seconds else None,
        "latency_max_s": max(seconds) if seconds else None,
        "failures": failures[:20],
        "fault_started_s": report.faults[0].started_s if report.faults else None,
        # Every request: when it started (since the run began), how long it took, how it ended.
        "requests_s": [(round(r.started_s, 2), round(r.seconds, 2), r.outcome, r.stream) for r in runner.results],
    }


def table(rows: list[dict]) -> str:
    base = rows[0]["latency_p50_s"]
    lines = ["| fault | requests | failed | worst latency | added over baseline median |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        worst = r["latency_max_s"]
        added = "" if r["fault"] is None or worst is None else f"{worst - base:+.1f} s"
        lines.append(f"| {r['fault'] or 'none (baseline)'} | {r['requests']} | {r['failed'] + r['hung']} "
                     f"| {worst:.1f} s | {added} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duet bench faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--outage-s", type=float, default=3.0, help="how long transfers fail and Redis is down")
    ap.add_argument("--no-redis", action="store_true", help="no Redis (prefix index, KV tier), no Redis fault")
    ap.add_argument("--redis-port", type=int, default=6395)
    ap.add_argument("--only", nargs="+", default=None, help="the faults whose names contain one of these words")
    ap.add_argument("--port", type=int, default=8073)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)

    overrides: dict[str, object] = {"gateway.port": a.port, "gateway.max_tokens": a.max_tokens}
    redis_port = None if a.no_redis else a.redis_port
    if redis_port is not None:
        _redis("start", redis_port)
        overrides.update({"router.prefix_index": "redis", "router.redis_url": f"redis://127.0.0.1:{redis_port}/0",
                          "cache.cpu_bytes": 64 << 20, "cache.redis_url": f"redis://127.0.0.1:{redis_port}/1"})
    plan = SoakPlan(num_requests=a.requests, concurrency=a.concurrency, disconnect_fraction=0.0,
                    stream_fraction=0.5, greedy_fraction=1.0, max_tokens=(a.max_tokens, a.max_tokens),
                    deadline_s=120.0)
    chosen = [c for c in cases(redis_port, a.outage_s) if not a.only or any(w in c.name for w in a.only)]
    print(f"CPU flags: {' '.join(cpu_flags())}", flush=True)
    url = serve_cli.start(load_config(overrides=overrides))
    rows = []
    try:
        for case in [None, *chosen]:
            _serving(url, 300)
            rows.append(soak(url, plan, case))
            r = rows[-1]
            print(f"  {r['fault'] or 'baseline'}: {r['failed']} failed of {r['requests']}, "
                  f"worst {r['latency_max_s']:.1f} s", flush=True)
    finally:
        serve_cli.stop()
        if redis_port is not None:
            _redis("stop", redis_port)
    print(table(rows))
    if a.json:
        write_json(a.json, {"cpu_flags": cpu_flags(), "plan": vars(a), "runs": rows, "table": table(rows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
