"""Who this replica is to its peers: its id (the one its KV events and leases carry)
and the address of its node (where peers reach its control port)."""

from __future__ import annotations

import os


def replica_id() -> str:
    """`deployment#unique_id` inside Ray Serve; `local-<pid>` outside it (tests, scripts)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"{ctx.deployment}#{ctx.replica_id.unique_id}"
    except Exception:
        return f"local-{os.getpid()}"


def node_ip() -> str:
    """This node's address in the Ray cluster; loopback outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
