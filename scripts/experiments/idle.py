"""`scripts/experiments/idle.py`: what a deployed cluster costs the machine while nobody calls it.

    python scripts/experiments/idle.py [--mode disaggregated|aggregated] [--requests 4] [--settle-s 10]
                    [--seconds 30] [--json PATH]

Deploys `duet serve`'s config (the README's layout; `--mode` picks the other), sends
`--requests` short completions so every path has run once (a handoff, its lease and
its release in P/D mode), waits `--settle-s` seconds, then reads every process's CPU
time twice, `--seconds` apart. Prints each kind of process's share of one core (Ray's
own, each pool's replicas, their engine core children, HAProxy) and their sum, and
writes the JSON. On a CPU server this is CPU the engine does not get: a busy loop in
an idle replica takes it from the replica's event loop (and its GIL) and from the
engine core beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run as a script

import argparse
import json
import os
import platform
import time
import urllib.request
from collections import Counter

import psutil

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from cluster import serve_cli
from cluster.config import load_config
from engine.weights import served_model_name


def _kind(p: psutil.Process) -> str | None:
    """What a process is, by its name and command line; None for processes not ours or Ray's."""
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return None
    if "engine.core_process" in cmd:
        return "engine core child"
    if name.startswith("ray::ServeReplica:"):
        return "replica " + name.rsplit(":", 1)[-1]
    if name.startswith("ray::"):
        return name.split(".")[0]  # ray::ServeController, ray::ProxyActor, ray::IDLE, ...
    for kind in ("gcs_server", "raylet", "dashboard", "log_monitor", "haproxy", "redis-server"):
        if kind in cmd:
            return kind
    return None


def _cpu_by_pid() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter():
        kind = _kind(p)
        if kind is None:
            continue
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[p.pid] = (kind, t.user + t.system)
    return out


def measure(seconds: float) -> dict[str, float]:
    """Each kind of process's CPU over `seconds`, as a share of one core (processes
    that start or stop in between are left out)."""
    before = _cpu_by_pid()
    start = time.monotonic()
    time.sleep(seconds)
    after = _cpu_by_pid()
    wall = time.monotonic() - start
    shares: Counter[str] = Counter()
    for pid, (kind, cpu) in after.items():
        if pid in before:
            shares[kind] += (cpu - before[pid][1]) / wall
    return dict(shares.most_common())


def _complete(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/experiments/idle.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["disaggregated", "aggregated"], default=None,
                   help="default: the config's (duet serve's) mode")
    p.add_argument("--config", default=None, help="a cluster config file (default: the built-in one)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--json", default="out/bench_idle.json")
    args = p.parse_args(argv)

    overrides = {"mode": args.mode} if args.mode else {}
    cfg = load_config(args.config, overrides=overrides)
    url = serve_cli.start(cfg)
    try:
        for _ in range(args.requests):
            _complete(url, served_model_name(cfg.engine))
        time.sleep(args.settle_s)
        shares = measure(args.seconds)
    finally:
        serve_cli.stop()
    print(f"an idle {cfg.mode} cluster, {args.seconds:.0f} s, share of one core per kind of process:")
    for kind, share in shares.items():
        print(f"  {100 * share:5.1f}%  {kind}")
    print(f"  {100 * sum(shares.values()):5.1f}%  all of them")
    write_json(args.json, {
        "mode": cfg.mode, "seconds": args.seconds, "requests": args.requests, "settle_s": args.settle_s,
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                    "cores": os.cpu_count()},
        "core_share": shares, "total": sum(shares.values()),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
