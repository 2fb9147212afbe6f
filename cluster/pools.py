"""One pool's sizing and placement (`prefill:`, `decode:`, `aggregated:` of the
cluster config), apart from the rest of `ClusterConfig`: the Serve controller reads
it to run the autoscaling policy, and must not import the engine (torch) to do so.

Placement: a pool with `node_group: prefill` runs only on Ray nodes that offer the
custom resource `duet/prefill` (`duet node --node-group prefill`, or a Helm worker
group). A node offers `NODE_GROUP_UNITS` of it and each replica takes one, so the
resource marks where a pool may run and CPUs/GPUs bound how many replicas fit.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from autoscaling.config import PoolAutoscaling

# The pools each mode deploys.
POOLS_BY_MODE: dict[str, tuple[str, ...]] = {"disaggregated": ("prefill", "decode"), "aggregated": ("aggregated",)}
# The pool whose replicas are the HTTP ingress (the gateway runs inside each): the one
# that decodes, so the replica that makes the tokens streams them.
INGRESS_POOL: dict[str, str] = {"disaggregated": "decode", "aggregated": "aggregated"}

NODE_GROUP_UNITS = 1000
NODE_GROUP_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$"


def node_group_resource(group: str) -> str:
    """The Ray custom resource that marks the nodes of `group`."""
    return f"duet/{group}"


def placement(group: str | None) -> dict[str, int]:
    """Ray custom resources one replica placed in `group` asks for (None: anywhere)."""
    return {node_group_resource(group): 1} if group else {}


def node_resources(groups: Iterable[str]) -> dict[str, int]:
    """What a Ray node that offers `groups` starts with (`ray start --resources`)."""
    return {node_group_resource(g): NODE_GROUP_UNITS for g in groups}


class PoolConfig(BaseModel):
    """How one pool is sized and placed: replicas, CPUs, GPUs and threads per replica,
    the node group it runs on, and how it scales (`autoscaling:` absent means
    `policy: fixed` at `replicas`)."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    # The engine's thread team. None: every core the replica may run on (its CPU
    # affinity); engine cores on one machine then lend each other the cores they are
    # not using (engine.share_cores), so a prefill and a decode replica colocated on a
    # few cores each get all of them when the other idles (the fastest layout measured
    # on two cores, docs/benchmarks.md). On a node per replica it is the node's cores.
    threads: int | None = Field(None, ge=1)
    # Run the replica's engine on the main thread of a child process it owns
    # (engine/core_process.py) instead of on a side thread of the replica. None: the
    # pool's default: on for the aggregated pool (measured faster,
    # docs/benchmarks.md) and, on a CPU, for prefill and decode (their KV tensor is
    # shared with the replica's transfer backend through CPU shared memory, so on a GPU
    # their engine runs on a thread). A prefill pool's LMCache tier lives with its engine.
    engine_process: bool | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    # Only on the nodes that offer `duet/<node_group>` (None: any node).
    node_group: str | None = Field(None, pattern=NODE_GROUP_PATTERN)
    autoscaling: PoolAutoscaling | None = None
    # Overrides engine.num_kv_blocks for this pool only (e.g. a small decode pool).
    num_kv_blocks: int | None = Field(None, ge=2)
    # A replica being stopped (scale-down, rolling update) gets no new work and keeps
    # serving what it has (streams; a prefill replica's leases) this long at most.
    drain_timeout_s: float = Field(60.0, ge=0)

    @property
    def scaling(self) -> str:
        """Who sizes the pool: `goodput`, `queue`, or `fixed` (also without `autoscaling:`)."""
        return "fixed" if self.autoscaling is None else self.autoscaling.policy

    def initial_replicas(self) -> int:
        """Replicas at deploy time: `replicas`, within the autoscaling bounds."""
        a = self.autoscaling
        if self.scaling == "fixed":
            return self.replicas
        return max(a.min_replicas, min(self.replicas, a.max_replicas))

    def resources(self) -> dict[str, float]:
        """Ray custom resources one replica asks for (its node group's marker)."""
        return placement(self.node_group)
