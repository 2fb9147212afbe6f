"""What the ingress request router (routing/router/ingress.py) costs and what it buys.

Serves the aggregated pool behind HAProxy (`duet serve --mode aggregated`) in four
setups, each on a fresh cluster started as `duet serve` starts it (`serve_cli.start`),
and drives each with `duet bench serve` in its own process:

- `one-balanced` / `one-routed`: one replica (two engine threads), `router.policy:
  default` (no router) against `kv_aware` (HAProxy asks the router first, with
  nothing to choose): the hop's cost, on random 128-token prompts at concurrency 1.
- `two-balanced` / `two-routed`: two replicas (one thread each), HAProxy's least
  connections against the KV-aware choice, on prompts drawn from 8 shared 512-token
  system prompts (+64 tokens each) at concurrency 4. The 8 prefixes take 256 blocks:
  one replica's whole pool (`engine.num_kv_blocks: 256`), half of each when split.

Rounds alternate the order (A B C D, D C B A) so the machine's drift falls on both
sides. Prints a table of medians and writes every run and the medians as JSON:

    .venv/bin/python scripts/experiments/ingress_routing.py --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.loadgen_subprocess import run_loadgen, summarize
from bench.machine_ceilings import cpu_flags
from cluster import serve_cli
from cluster.config import load_config

PORT = 8031
SETUPS = {
    "one-balanced": dict(replicas=1, threads=2, num_cpus=1.0, policy="default"),
    "one-routed": dict(replicas=1, threads=2, num_cpus=1.0, policy="kv_aware"),
    "two-balanced": dict(replicas=2, threads=1, num_cpus=0.5, policy="default"),
    "two-routed": dict(replicas=2, threads=1, num_cpus=0.5, policy="kv_aware"),
}
WORKLOADS = {
    "one": ["--workload", "random", "--input-len", "128", "--output-len", "32", "--concurrency", "1",
            "--num-prompts", "24", "--warmup", "2"],
    "two": ["--workload", "shared-prefix", "--num-prefixes", "8", "--prefix-len", "512", "--input-len", "64",
            "--output-len", "32", "--concurrency", "4", "--num-prompts", "64", "--warmup", "0"],
}


def run(setup: str) -> dict:
    """One setup on a fresh `duet serve` (serve_cli.start, as the CLI does), driven once."""
    s = SETUPS[setup]
    cfg = load_config(overrides={
        "mode": "aggregated", "engine.num_kv_blocks": 256, "engine.max_model_len": 1024,
        "aggregated.replicas": s["replicas"], "aggregated.threads": s["threads"], "aggregated.num_cpus": s["num_cpus"],
        "gateway.ingress": "haproxy", "gateway.port": PORT, "router.policy": s["policy"]})
    url = serve_cli.start(cfg)
    try:
        with tempfile.TemporaryDirectory() as d:
            point = run_loadgen(url, Path(d), ["--ignore-eos", "--seed", "0", *WORKLOADS[setup.split("-")[0]]])[0]
    finally:
        serve_cli.stop()
    rows = [r for r in point["requests"] if r.get("outcome") == "completed"]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r.get("server_cached_tokens") or 0 for r in rows)
    return {"setup": setup, **summarize(point), "cached_share": cached / prompt if prompt else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    runs = []
    for i in range(a.rounds):
        for setup in a.setups if i % 2 == 0 else reversed(a.setups):
            r = run(setup) | {"round": i + 1}
            print(json.dumps(r), flush=True)
            runs.append(r)
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s", "cached_share")
    medians = {s: {k: statistics.median(r[k] for r in runs if r["setup"] == s) for k in keys} for s in a.setups}
    print(f"\n{'setup':<14}" + "".join(f"{k:>14}" for k in keys))
    for s, m in medians.items():
        print(f"{s:<14}" + "".join(f"{m[k]:>14.3f}" for k in keys))
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "medians": medians, "cpus": os.cpu_count(),
                                      "cpu_flags": cpu_flags()}, indent=1))


if __name__ == "__main__":
    main()
