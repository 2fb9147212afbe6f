"""`duet cluster`: Ray nodes that offer duet's node groups.

    duet cluster node --head --node-group gateway            # on the head machine
    duet cluster node --address HEAD:6380 --node-group prefill --num-gpus 1
    duet cluster netns up | down | status                     # a 3-node cluster on this machine (root)

`node` is `ray start` with the `duet/<group>` resources a pool's `node_group` asks
for (cluster/pools.py); `netns` builds the namespace cluster of cluster/netns.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from cluster.netns import RAY_PORT
from cluster.pools import node_resources


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="start Ray nodes for duet's node groups, or a local multi-node cluster")
    cmds = p.add_subparsers(dest="cluster_cmd", required=True)
    node = cmds.add_parser("node", help="`ray start` offering duet node groups")
    where = node.add_mutually_exclusive_group(required=True)
    where.add_argument("--head", action="store_true", help="start the head node")
    where.add_argument("--address", help="join the cluster whose head is here (HOST:PORT)")
    node.add_argument("--node-group", action="append", default=[], help="a duet node group this node offers")
    node.add_argument("--num-cpus", type=float, default=None)
    node.add_argument("--num-gpus", type=float, default=None)
    node.add_argument("--node-ip-address", default=None, help="the address other nodes reach this one at")
    node.add_argument("--port", type=int, default=RAY_PORT, help="the head's GCS port")
    node.add_argument("--dry-run", action="store_true", help="print the `ray start` command and exit")
    ns = cmds.add_parser("netns", help="a head, a prefill and a decode node in network namespaces (root, Linux)")
    ns.add_argument("action", choices=["up", "down", "status"])


def node_argv(args) -> list[str]:
    argv = ["ray", "start", "--disable-usage-stats"]
    argv += ["--head", "--port", str(args.port)] if args.head else ["--address", args.address]
    if args.node_group:
        argv += ["--resources", json.dumps(node_resources(args.node_group))]
    for flag, value in (("--num-cpus", args.num_cpus), ("--num-gpus", args.num_gpus),
                        ("--node-ip-address", args.node_ip_address)):
        if value is not None:
            argv += [flag, f"{value:g}" if isinstance(value, float) else value]
    return argv


def run(args) -> int:
    if args.cluster_cmd == "node":
        argv = node_argv(args)
        print(shlex.join(argv), flush=True)
        if args.dry_run:
            return 0
        return subprocess.call(argv, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    return _netns(args.action)


def _netns(action: str) -> int:
    from cluster import netns

    why = netns.available()
    if why:
        print(f"duet cluster netns: {why}", file=sys.stderr)
        return 2
    c = netns.NamespaceCluster()
    if action == "down":
        c.stop()
        print("namespace cluster removed")
        return 0
    if action == "status":
        try:
            print(json.dumps({"address": c.address, "alive": c.alive_nodes()}))
            return 0
        except Exception as e:
            print(f"not running: {e}", file=sys.stderr)
            return 1
    c.stop()  # a stale one from an earlier run
    c.start()
    print(f"Ray cluster at {c.address}; bridge {c.bridge_ip} (host side)")
    for n in c.nodes:
        print(f"  {c.netns(n.name):14} {c.ip(n.name):12} groups {', '.join(n.node_groups) or '-'}")
    print(f"next: sudo ip netns exec {c.netns(c.head.name)} duet serve --address {c.address} "
          "--config deploy/multinode.yaml")
    return 0
