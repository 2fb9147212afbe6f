"""Handoff cost per request: time, bytes and GB/s to move a prompt's KV blocks.

    duet bench kv --json PATH [--runs 9] [--backends nixl,torch] [--netns]

Two OS processes on this host (the prefill peer is a child process); with --netns
also between two Ray nodes in network namespaces (`nixl/tcp`, `torch/tcp`: the
multi-node path over TCP, bench/kv_across_nodes.py), SmolLM2-135M's
KV shape (30 layers, 3 KV heads, head_dim 64, bf16, block_size 16), prompts of
128/512/2048 tokens, random non-contiguous block ids on both sides (what a block
pool hands out). In-process baselines: ``memcpy`` gathers the blocks with
``index_select`` into a fresh buffer and ``index_copy_``s them into place (two
copies plus page faults on the new buffer, what the torch backend does on its two
sides); ``blockcp`` copies block by block, once, with no allocation (the floor).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from bench.json_output import write_json
from kvtransfer.backends import KVTransferBackend, PeerInfo, make_backend
from kvtransfer.peer_process import KVSpec, PrefillPeer

SMOLLM2 = KVSpec(num_blocks=320, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
PROMPTS = (128, 512, 2048)


@dataclass(frozen=True)
class Result:
    backend: str
    prompt_tokens: int
    num_blocks: int
    bytes: int
    median_ms: float
    min_ms: float
    max_ms: float
    gbps: float
    runs: int
    first_pull_ms: float | None = None


def _block_ids(spec: KVSpec, n: int, seed: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    remote = torch.randperm(spec.num_blocks, generator=gen)[:n].tolist()
    local = torch.randperm(spec.num_blocks, generator=gen)[:n].tolist()
    return remote, local


def _result(backend: str, tokens: int, n: int, bpb: int, times: list[float], first: float | None) -> Result:
    med = statistics.median(times)
    return Result(
        backend, tokens, n, n * bpb, med * 1e3, min(times) * 1e3, max(times) * 1e3,
        n * bpb / med / 1e9, len(times), None if first is None else first * 1e3,
    )


def bench_memcpy(spec: KVSpec, runs: int) -> list[Result]:
    src, dst = spec.filled(0), spec.zeros()
    bpb = src[0].numel() * src.element_size()
    out = []
    for tokens in PROMPTS:
        n = math.ceil(tokens / spec.block_size)
        remote, local = _block_ids(spec, n, tokens)
        r_idx, l_idx = torch.tensor(remote), torch.tensor(local)
        times, block_times = [], []
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            dst.index_copy_(0, l_idx, src.index_select(0, r_idx))
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for r, loc in zip(remote, local):
                dst[loc].copy_(src[r])
            block_times.append(time.perf_counter() - t0)
        out.append(_result("memcpy", tokens, n, bpb, times[1:], None))
        out.append(_result("blockcp", tokens, n, bpb, block_times[1:], None))
    return out


def bench_backend(name: str, spec: KVSpec, runs: int) -> list[Result]:
    kw = {"host": "127.0.0.1"} if name == "torch" else {}
    with PrefillPeer(name, spec, seed=1, **kw) as peer, make_backend(name, "bench-decode", "test-model", **kw) as b:
        return pull_series(b, peer.peer_info, spec, runs, name)


def pull_series(b: KVTransferBackend, peer: PeerInfo, spec: KVSpec, runs: int, label: str) -> list[Result]:
    """Pull each prompt's blocks `runs` + 1 times from the peer that serves
    `spec.filled(seed=1)` (the first run warms up) and check the bytes."""
    expected = spec.filled(seed=1)
    kv = spec.zeros()
    b.register(kv)
    t0 = time.perf_counter()
    b.pull(peer, [0], [0], timeout_s=30)  # connection setup and warm-up
    first = time.perf_counter() - t0
    out = []
    for tokens in PROMPTS:
        n = math.ceil(tokens / spec.block_size)
        remote, local = _block_ids(spec, n, tokens)
        times = []
        for _ in range(runs + 1):
            kv[local] = 0
            times.append(b.pull(peer, remote, local, timeout_s=30).seconds)
        if not torch.equal(kv[local].view(torch.uint8), expected[remote].view(torch.uint8)):
            raise AssertionError(f"{label}: pulled bytes differ from the source")
        out.append(_result(label, tokens, n, b.fingerprint.bytes_per_block, times[1:], first))
    return out


def across_nodes(backends: list[str], runs: int) -> list[Result]:
    """The same pulls between Ray nodes in network namespaces (cluster/netns.py):
    a cluster of its own, the driver in its head node's namespace."""
    from cluster.netns import NamespaceCluster, available

    why = available()
    if why:
        raise SystemExit(f"--netns: {why}")
    c = NamespaceCluster(prefix="duetb", subnet="10.79.0")
    c.stop()
    try:
        c.start()
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/results.json"
            argv = [sys.executable, "-m", "bench.kv_across_nodes", "--address", c.address, "--json", path,
                    "--backends", ",".join(backends), "--runs", str(runs)]
            out = subprocess.run(c.in_netns(c.head.name, argv), capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"the cross-node benchmark failed: {out.stderr[-3000:]}")
            with open(path) as f:
                return [Result(**r) for r in json.load(f)]
    finally:
        c.stop()


def _table(results: list[Result]) -> str:
    head = f"{'prompt':>7} {'blocks':>6} {'MB':>7} {'backend':>9} {'median ms':>10} {'min ms':>8} {'GB/s':>6}"
    rows = [head, "-" * len(head)]
    for r in sorted(results, key=lambda r: (r.prompt_tokens, r.backend)):
        rows.append(
            f"{r.prompt_tokens:>7} {r.num_blocks:>6} {r.bytes / 1e6:>7.2f} {r.backend:>9} "
            f"{r.median_ms:>10.3f} {r.min_ms:>8.3f} {r.gbps:>6.2f}"
        )
    firsts = {r.backend: r.first_pull_ms for r in results if r.first_pull_ms is not None}
    rows.append("first pull to a new peer (connect + warm-up), ms: "
                + ", ".join(f"{k} {v:.1f}" for k, v in firsts.items()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duet bench kv", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write results here")
    parser.add_argument("--runs", type=int, default=9, help="timed runs per point (median reported)")
    parser.add_argument("--backends", default="nixl,torch")
    parser.add_argument("--netns", action="store_true",
                        help="also pull between Ray nodes in network namespaces over TCP (root; the multi-node path)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # copies with 2 threads on 2 cores were 10x slower (measured)

    results = bench_memcpy(SMOLLM2, args.runs)
    for name in args.backends.split(","):
        results += bench_backend(name, SMOLLM2, args.runs)
    if args.netns:
        results += across_nodes(args.backends.split(","), args.runs)
    print(_table(results))
    report = {
        "spec": asdict(SMOLLM2),
        "bytes_per_block": SMOLLM2.zeros()[0].numel() * 2,
        "host": {"machine": platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "results": [asdict(r) for r in results],
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
