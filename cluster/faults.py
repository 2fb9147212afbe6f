"""Faults injected into a running duet cluster, from a Ray driver connected to it: the
chaos soak, the fault table (`duet bench faults`) and the reliability tests use them.

Each acts on one Serve replica, named by its replica id (`decode#abc`, as the replicas'
`stats()` report it), and works wherever the replica runs: what must happen inside the
replica (killing its engine core child, expiring its leases) runs in its actor.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from cluster.serve_config import APP_NAME

T = TypeVar("T")
REPLICA_ACTOR_PREFIX = f"SERVE_REPLICA::{APP_NAME}#"  # + a replica id (`decode#abc`)


def replica_actor(replica_id: str):
    """The Ray actor of one Serve replica (`decode#abc` → SERVE_REPLICA::duet#decode#abc)."""
    import ray

    return ray.get_actor(f"{REPLICA_ACTOR_PREFIX}{replica_id}", namespace="serve")


def live_replicas(pool: str) -> set[str]:
    """Replica ids (`decode#abc`) of `pool` whose actors are alive."""
    import ray

    return {a["name"].removeprefix(REPLICA_ACTOR_PREFIX) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"{REPLICA_ACTOR_PREFIX}{pool}#")}


def in_replica(replica_id: str, fn: Callable[[Any], T], timeout_s: float = 60) -> T:
    """`fn(the replica's deployment instance)`, run in that replica's actor: a call
    through a handle (or HTTP) lands on any replica of the pool. Reaches into Serve's
    replica actor (Ray 2.60's attribute names)."""
    import ray

    def call(actor) -> T:
        return fn(actor._replica_impl._user_callable_wrapper.user_callable)

    return ray.get(replica_actor(replica_id).__ray_call__.remote(call), timeout=timeout_s)


def kill_replica(replica_id: str) -> None:
    """Kill one Serve replica's actor; Serve replaces it."""
    import ray

    ray.kill(replica_actor(replica_id), no_restart=True)


def engine_core_pids(parent: int) -> list[int]:
    """The engine core children (engine/core_process.py) of process `parent`."""
    cores = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:  # the parent pid is the 2nd field after the command in parentheses
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"engine.core_process" in (proc / "cmdline").read_bytes():
                cores.append(int(proc.name))
        except (OSError, IndexError, ValueError):  # a process that ended while we read it
            continue
    return cores


def kill_engine_core(replica_id: str) -> int:
    """SIGKILL one Serve replica's engine core child (the replica stays); its pid."""
    import ray

    def kill(_actor) -> int:
        cores = engine_core_pids(os.getpid())
        if len(cores) != 1:
            raise RuntimeError(f"replica {replica_id} (pid {os.getpid()}) has engine cores {cores}")
        os.kill(cores[0], signal.SIGKILL)
        return cores[0]

    return ray.get(replica_actor(replica_id).__ray_call__.remote(kill), timeout=30)


def fail_transfers(replica_id: str, seconds: float) -> int:
    """For `seconds`, every lease a prefill replica grants expires at once, so each
    decode replica's pull of it fails (its Release finds no lease) as a lost or timed
    out transfer would; how many expired."""
    def expire_all(served) -> int:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            n += len(served.exporter.leases.expire(now=float("inf")))
            time.sleep(0.001)
        return n

    return in_replica(replica_id, expire_all, timeout_s=seconds + 60)
