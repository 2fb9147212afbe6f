"""Who this replica is to its peers: its id (the one its KV events and leases carry)
and the address of its node (where peers reach its control port); and how a pool
replica runs its shutdown steps."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


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


def close_in_order(steps: Iterable[Callable[[], None]], role: str) -> None:
    """A replica's shutdown steps, in order: one that raises is logged and the rest
    still run (a failed telemetry flush must not leave the engine thread running)."""
    for close in steps:
        try:
            close()
        except Exception:
            log.exception("%s shutdown step failed", role)
