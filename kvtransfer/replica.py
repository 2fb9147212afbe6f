"""Who this replica is to its peers: its id (the one its KV events and leases carry)
and the address of its node (where peers reach its control port); and how a pool
replica runs its shutdown steps, and retires what a replaced engine core left."""

from __future__ import annotations

import logging
import os
import threading
import time
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


def retire_in_background(idle: Callable[[], bool], steps: Iterable[Callable[[], None]], role: str,
                         within_s: float) -> threading.Thread:
    """Close what a replaced engine core left (its transfer backend, lease exporter)
    on a thread of its own, once `idle()` says nothing uses them any more (its leases
    ended, its imports done) or after `within_s`, whichever comes first."""

    def run() -> None:
        deadline = time.monotonic() + within_s
        while not idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        close_in_order(steps, role)

    thread = threading.Thread(target=run, name=f"duet-{role}-retire", daemon=True)
    thread.start()
    return thread
