"""Shared helpers for the KV routing and LMCache tier integration tests (issue 5).

Not a conftest: the modules import it. Each module starts one Ray cluster and one
Serve app (redeploying it with other configs when a test needs to), and a private
Redis on its own port through scripts/redis.sh.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Own app name and route prefix: another module's app may share the Ray cluster.
APP = "duet-kv"
PREFIX = "/kv"


def free_port() -> int:
    """A free port for Serve's proxy, from 20000-29999: below the kernel's ephemeral
    range and above Ray's worker ports (10002-19999), so the processes Ray starts
    between this check and the proxy's bind cannot take it (an ephemeral port can)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


class RedisServer:
    """A private Redis (scripts/redis.sh) that a test may stop and start."""

    def __init__(self, port: int, directory: Path):
        self.port = port
        self.env = dict(os.environ, DUET_REDIS_PORT=str(port), DUET_REDIS_DIR=str(directory))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def run(self, cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO / "scripts" / "redis.sh"), cmd], env=self.env,
                              capture_output=True, text=True, timeout=120)

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()


def base_config(port: int, **sections) -> dict:
    """A small fp32 cluster (exact greedy comparisons); the gateway on `port`."""
    cfg = {
        "engine": {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "max_num_batched_tokens": 512,
                   "num_kv_blocks": 256, "max_num_seqs": 16},
        "prefill": {"replicas": 1, "num_cpus": 0.25, "threads": 1},
        "decode": {"replicas": 1, "num_cpus": 0.25, "threads": 1},
        "transfer": {"backend": "torch", "lease_ttl_s": 5.0},
        "gateway": {"port": port, "num_cpus": 0.1},
    }
    for name, value in sections.items():
        cfg[name] = {**cfg.get(name, {}), **value} if isinstance(value, dict) else value
    return cfg


def start_ray(port: int) -> tuple[bool, int]:
    """Start Ray and Serve's proxy on `port`, or join the session's cluster (then
    its proxy port is used). Returns (owned, http port)."""
    import ray
    from ray import serve

    from cluster.app import REPLICA_ENV

    if ray.is_initialized():
        from duet_cluster import PORT

        return False, PORT
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": REPLICA_ENV})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return True, port


def stop_ray(owned: bool) -> None:
    import ray
    from ray import serve

    if owned:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP)


def deploy(cfg_dict: dict, timeout: float = 240.0) -> str:
    """(Re)deploy the app from a config dict; returns the base URL once /ready."""
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.serve_cli import wait_ready

    cfg = ClusterConfig.model_validate(cfg_dict)
    serve.run(build_app(cfg), name=APP, route_prefix=PREFIX, blocking=False)
    url = f"http://127.0.0.1:{cfg.gateway.port}{PREFIX}"
    wait_ready(url, timeout)
    wait_replicas("prefill", cfg.prefill.replicas, timeout)
    return url


def wait_replicas(deployment: str, n: int, timeout: float = 120.0) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = serve.status().applications[APP].deployments[deployment]
        running = st.replica_states.get("RUNNING", 0)
        if running == n and sum(st.replica_states.values()) == n:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{deployment} did not reach {n} running replicas")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def complete(url: str, ids: list[int], max_tokens: int = 8, session: str | None = None, timeout: float = 120) -> dict:
    body = json.dumps({"model": "smollm2-135m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    headers = {"content-type": "application/json"}
    if session:
        headers["x-session-id"] = session
    req = urllib.request.Request(f"{url}/v1/completions", body, headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def cached_tokens(resp: dict) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def prefill_handle():
    from ray import serve

    return serve.get_deployment_handle("prefill", APP)


async def prefill_direct(handle, ids: list[int], session: str | None = None, rid: str | None = None):
    """One prefill through the pool's router; the lease is rejected at once."""
    from engine.sampling_params import SamplingParams

    rid = rid or f"t-{random.getrandbits(48):x}"
    result = await handle.prefill.remote(rid, ids, SamplingParams(max_tokens=4, temperature=0), session_id=session)
    reject_now(result)
    return result


async def router_settled(handle, timeout: float = 30.0) -> None:
    """Wait until the KV-aware router Serve built in this process for `handle` has seen
    every request it sent complete (its completion callbacks run on Serve's router
    thread, possibly after the caller already has the result)."""
    import asyncio

    router = handle._router._asyncio_router.request_router
    deadline = time.monotonic() + timeout
    while router.pending():
        assert time.monotonic() < deadline, "the router never saw its requests complete"
        await asyncio.sleep(0.02)


def reject_now(result) -> None:
    """Free a prefill result's lease at once (nobody will pull it)."""
    from kvtransfer.handoff import reject_lease
    from kvtransfer.messages import RejectReason

    if result.kv_handle is not None:
        reject_lease(result.kv_handle, RejectReason.CLIENT_DISCONNECTED, timeout_s=5.0)


def kill_replicas(deployment: str) -> list[str]:
    """Kill the deployment's replica actors (Serve starts new ones)."""
    import ray

    killed = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#{deployment}#"):
            ray.kill(ray.get_actor(name, namespace=a["namespace"]), no_restart=True)
            killed.append(name)
    return killed
