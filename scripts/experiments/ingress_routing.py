"""What the ingress request router (routing/router/ingress.py) costs and what it buys.

Serves the aggregated pool colocated behind HAProxy (`duet serve --colocate --ingress
haproxy`) in four setups, each on a fresh `duet serve`, and drives each with `duet
bench serve`:

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
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DUET = str(Path(sys.executable).with_name("duet"))
PORT = 8031
CONFIG = """\
mode: aggregated
engine: {{dtype: auto, num_kv_blocks: 256, max_model_len: 1024}}
aggregated: {{replicas: {replicas}, threads: {threads}, num_cpus: {num_cpus}}}
gateway: {{colocate: true, ingress: haproxy, port: {port}}}
router: {{policy: {policy}}}
"""
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


def serve(setup: str, root: Path) -> subprocess.Popen:
    (root / "cluster.yaml").write_text(CONFIG.format(port=PORT, **SETUPS[setup]))
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([DUET, "serve", "--config", str(root / "cluster.yaml"), "--ready-timeout", "300"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 360
    while "duet is serving" not in (root / "serve.log").read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{setup}: duet serve did not start; see {root / 'serve.log'}")
        time.sleep(1)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run(setup: str, root: Path) -> dict:
    proc = serve(setup, root)
    try:
        out = root / "bench"
        subprocess.run([DUET, "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}", "--ignore-eos",
                        "--no-progress", "--seed", "0", "--out", str(out), *WORKLOADS[setup.split("-")[0]]],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        stop(proc)
    point = json.loads((out / "results.json").read_text())[0]
    rows = [r for r in point["requests"] if r.get("outcome") == "completed"]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r.get("server_cached_tokens") or 0 for r in rows)
    return {"setup": setup, "completed": len(rows), "ttft_p50_ms": point["metrics"]["ttft_ms"]["median"],
            "ttft_p99_ms": point["metrics"]["ttft_ms"]["p99"], "tpot_p50_ms": point["metrics"]["tpot_ms"]["median"],
            "output_tok_s": point["metrics"]["output_throughput"], "cached_share": cached / prompt if prompt else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    runs = []
    for i in range(a.rounds):
        for setup in a.setups if i % 2 == 0 else reversed(a.setups):
            with tempfile.TemporaryDirectory(prefix=f"ingress-{setup}-") as d:
                r = run(setup, Path(d)) | {"round": i + 1}
            print(json.dumps(r), flush=True)
            runs.append(r)
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s", "cached_share")
    medians = {s: {k: statistics.median(r[k] for r in runs if r["setup"] == s) for k in keys} for s in a.setups}
    print(f"\n{'setup':<14}" + "".join(f"{k:>14}" for k in keys))
    for s, m in medians.items():
        print(f"{s:<14}" + "".join(f"{m[k]:>14.3f}" for k in keys))
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "medians": medians, "cpus": os.cpu_count(),
                                      "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
                                      "machine": platform.machine()}, indent=1))


if __name__ == "__main__":
    main()
