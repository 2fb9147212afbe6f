"""The handoff between Ray nodes, for `duet bench kv --netns`: run inside the head
node's namespace of a namespace cluster (cluster/netns.py). An actor on the prefill
node serves a filled KV tensor; an actor on the decode node pulls it with the same
series as the same-host benchmark. NIXL is held to UCX's TCP transport and gloo binds
each node's own address: what crosses is the network, as between machines.

    python -m bench.kv_across_nodes --address HEAD:PORT --json PATH [--backends nixl,torch] [--runs 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import ray

from bench.kv import SMOLLM2, pull_series
from cluster.pools import node_group_resource


def _backend(name: str, replica_id: str):
    """`name`'s backend as a replica on this node makes it, with UCX held to TCP."""
    from kvtransfer.backends import backend_for
    from kvtransfer.config import TransferConfig
    from kvtransfer.replica import node_ip

    return backend_for(TransferConfig(backend=name, ucx_tls="tcp,self"), replica_id, "test-model", host=node_ip())


@ray.remote
class _Prefill:
    def __init__(self, name: str):
        import torch

        torch.set_num_threads(1)
        self.kv = SMOLLM2.filled(seed=1)
        self.backend = _backend(name, "bench-prefill")
        self.backend.register(self.kv)

    def peer_info(self):
        return self.backend.peer_info()


@ray.remote
class _Decode:
    def run(self, name: str, peer, runs: int) -> list[dict]:
        import torch

        torch.set_num_threads(1)
        with _backend(name, "bench-decode") as b:
            return [dataclasses.asdict(r) for r in pull_series(b, peer, SMOLLM2, runs, f"{name}/tcp")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--backends", default="nixl,torch")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args(argv)
    ray.init(address=args.address, logging_level="ERROR")
    results: list[dict] = []
    for name in args.backends.split(","):
        prefill = _Prefill.options(resources={node_group_resource("prefill"): 1}).remote(name)
        decode = _Decode.options(resources={node_group_resource("decode"): 1}).remote()
        results += ray.get(decode.run.remote(name, ray.get(prefill.peer_info.remote()), args.runs))
        for actor in (prefill, decode):
            ray.kill(actor)
    with open(args.json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
