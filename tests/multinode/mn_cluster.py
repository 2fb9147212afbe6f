"""What the multi-node tests share: the cluster config they deploy, `duet serve` in
the head's namespace, and reading each node's own metrics."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from cluster import netns

# The greedy chat every multinode test checks against the single-process engine.
CHAT = "What is the capital of France?"
MAX_TOKENS = 24
REPO = Path(__file__).resolve().parents[2]
HTTP_PORT = 8000
REDIS_PORT = 6396
# SmolLM2-135M fp32: layers x (K, V) x block_size x kv_heads x head_dim x 4 bytes.
BLOCK_SIZE = 16
BYTES_PER_BLOCK = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4
LEASE_TTL_S = 10.0


def cluster_config(mn: netns.NamespaceCluster, redis_url: str, backend: str) -> dict:
    """duet on the namespace cluster: each pool on its own node, KV over TCP (UCX may
    not use shared memory), the prefix index and an LMCache tier in that Redis."""
    return {
        "engine": {"dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "max_model_len": 1024},
        "prefill": {"node_group": "prefill", "num_cpus": 1, "threads": 1},
        # 0.75 + the gateway's 0.25 (it runs inside the decode replica) = the node's CPU.
        "decode": {"node_group": "decode", "num_cpus": 0.75, "threads": 1},
        "transfer": {"backend": backend, "ucx_tls": "tcp,self", "lease_ttl_s": LEASE_TTL_S},
        "router": {"prefix_index": "redis", "redis_url": f"{redis_url}/0"},
        "cache": {"redis_url": f"{redis_url}/1", "chunk_size": BLOCK_SIZE},
        "gateway": {"host": "0.0.0.0", "port": HTTP_PORT},
    }


def wait_serve_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until `url`/ready answers 200; fails with the log's tail if `duet serve` exits
    first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"duet serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url}/ready not 200 within {timeout_s:.0f} s: {log.read_text()[-3000:]}")


def stop_serve(proc: subprocess.Popen, timeout_s: float) -> None:
    """Ctrl-C's path: `duet serve` shuts Serve down (every replica) and exits; killed
    if it has not within `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


class DuetServe:
    """`duet serve --address` in the head's namespace, in the background (from the
    cluster's image when it runs from one: then file arguments must be paths inside it)."""

    def __init__(self, mn: netns.NamespaceCluster, args: list[str], log: Path):
        self.mn, self.log = mn, log
        self.url = f"http://{mn.ip(mn.head.name)}:{HTTP_PORT}"
        duet = [mn.executable("duet")] if mn.rootfs else [sys.executable, "-m", "cluster.cli"]
        argv = [*duet, "serve", "--address", mn.address, *args]
        self.proc = subprocess.Popen(mn.in_netns(mn.head.name, argv), cwd=mn.rootfs or REPO, env=mn.node_env(),
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_serve_ready(self.url, self.proc, self.log, timeout_s)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def stop(self) -> None:
        stop_serve(self.proc, timeout_s=90)


def scrape(mn: netns.NamespaceCluster, node: str) -> dict[str, list[tuple[dict, float]]]:
    """The Prometheus series that node's Ray metrics agent serves (its processes only)."""
    text = httpx.get(mn.metrics_url(node), timeout=10).text
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
        out.setdefault(name, []).append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def settled(mn: netns.NamespaceCluster, node: str, *names: str, timeout_s: float = 60.0) -> dict:
    """`node`'s series once `names` stop changing: replicas export every second and
    their stats reporters every 2 s, so a scrape may lag the last request."""
    deadline = time.monotonic() + timeout_s
    last = scrape(mn, node)
    while time.monotonic() < deadline:
        time.sleep(3)
        now = scrape(mn, node)
        if all(total(now, n) == total(last, n) for n in names):
            return now
        last = now
    raise AssertionError(f"{names} on {node} still changing after {timeout_s:.0f} s")


def total(series: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in series.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def wait_for(pred, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # a node or replica coming back
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def complete_unique(url: str, words: int = 40) -> int:
    """A completion whose prompt no earlier request cached (its first block is new);
    returns its prompt tokens."""
    prompt = f"[{uuid.uuid4().hex}] " + " ".join(f"word{i}" for i in range(words))
    r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 3,
                                                   "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]
