"""Router policy: pure functions that pick a replica from a snapshot.

The deployment gathers `ReplicaSnapshot`s (from the replicas' routing stats) and
the prefix index's `match()` result, calls `choose_prefill` / `choose_decode`,
and applies the `RoutingDecision`. Nothing here does I/O or holds state, so the
policy is unit-tested in milliseconds.

Prefill cost per replica, in units of KV blocks:

    cost = overlap_weight * blocks_to_compute + load
    load = queued_prefill_tokens / block_size + running_weight * running_requests

When ``max(load) - min(load) > imbalance_threshold`` the prefix term and the
session hint are ignored and load alone decides: a hot prefix cached on one
replica must not pull every request there while the other idles.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from autoscaling.placement import DisaggregationConfig
from kvtransfer.events.config import PrefixIndexConfig


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """What the router knows about one replica at decision time."""

    replica_id: str
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0


class RouterConfig(PrefixIndexConfig):
    """The cluster config's `router:` section: the policy's weights, how often replicas
    report, and (inherited) where the prefix index lives."""

    # kv_aware: the routers below; default: Serve's power-of-two choices.
    policy: Literal["kv_aware", "default"] = "kv_aware"
    # Cost of one block to compute, relative to one block of queued prefill.
    overlap_weight: float = Field(1.0, ge=0, allow_inf_nan=False)
    # Load added per running request, in blocks.
    running_weight: float = Field(1.0, ge=0, allow_inf_nan=False)
    # Softmax temperature over -cost; 0 = argmin with a stable tie-break.
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    # Load spread (blocks) beyond which load alone decides.
    imbalance_threshold: float = Field(64.0, gt=0)
    # Cost reduction (blocks) for the replica a session last used.
    session_affinity_bonus: float = Field(8.0, ge=0, allow_inf_nan=False)
    # Decode: cost of a fully used KV pool, in running sequences.
    decode_kv_weight: float = Field(4.0, ge=0, allow_inf_nan=False)
    # How often each replica reports its load (and, for `memory`, its KV event log).
    stats_period_s: float = Field(0.25, gt=0)
    # Per request: through the prefill pool, or prefilled where it decodes
    # (autoscaling/placement.py).
    disaggregation: DisaggregationConfig = DisaggregationConfig()


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """The chosen replica, the prefix it holds and why it won."""

    replica_id: str
    cached_blocks: int
    cost: float
    # "prefix" | "load" | "imbalance" | "affinity" | "sampled" | "kv" | "no-fit" | "fork"
    reason: str
    candidates: tuple[tuple[str, float], ...] = ()  # (replica, cost) of every candidate


def prefill_load(snapshot: ReplicaSnapshot, config: RouterConfig, block_size: int) -> float:
    """Queued prefill work in blocks plus a charge per running request."""
    return (
        snapshot.queued_prefill_tokens / block_size
        + config.running_weight * snapshot.running_requests
    )


def prefill_costs(
    num_prompt_tokens: int,
    snapshots: Sequence[ReplicaSnapshot],
    cached_blocks: Mapping[str, int],
    config: RouterConfig,
    block_size: int,
    preferred_replica: str | None = None,
) -> tuple[list[float], bool]:
    """Cost of each snapshot, and whether the imbalance guard fired."""
    prompt_blocks = -(-num_prompt_tokens // block_size)
    loads = [prefill_load(s, config, block_size) for s in snapshots]
    imbalanced = len(loads) > 1 and max(loads) - min(loads) > config.imbalance_threshold
    if imbalanced:
        return loads, True
    costs = []
    for snap, load in zip(snapshots, loads):
        cached = min(cached_blocks.get(snap.replica_id, 0), prompt_blocks)
        cost = config.overlap_weight * (prompt_blocks - cached) + load
        if snap.replica_id == preferred_replica:
            cost -= config.session_affinity_bonus
        costs.append(cost)
    return costs, False


def choose_prefill(
    num_prompt_tokens: int,
    snapshots: Sequence[ReplicaSnapshot],
    cached_blocks: Mapping[str, int],
    config: RouterConfig,
    block_size: int,
    preferred_replica: str | None = None,
    rng: random.Random | None = None,
) -> RoutingDecision:
    """Pick a prefill replica.

    `cached_blocks` is the prefix index's `match()` (replica id → leading blocks
    cached); `preferred_replica` is the session-affinity hint, if any.
    """
    if not snapshots:
        raise ValueError("choose_prefill: no prefill replicas")
    costs, imbalanced = prefill_costs(
        num_prompt_tokens, snapshots, cached_blocks, config, block_size, preferred_replica
    )
    i, sampled = _pick(costs, snapshots, config.temperature, rng)
    snap = snapshots[i]
    cached = min(cached_blocks.get(snap.replica_id, 0), -(-num_prompt_tokens // block_size))
    if imbalanced:
        reason = "imbalance"
    elif sampled:
        reason = "sampled"
    elif snap.replica_id == preferred_replica and config.session_affinity_bonus > 0:
        reason = "affinity"
    elif cached > 0:
        reason = "prefix"
    else:
        reason = "load"
    return RoutingDecision(snap.replica_id, cached, costs[i], reason, _candidates(snapshots, costs))


def decode_cost(snapshot: ReplicaSnapshot, config: RouterConfig) -> float:
    """Running sequences plus a charge for the used fraction of the KV pool.

    A replica that has not reported yet (`total_kv_blocks` 0) has just started, and a
    new engine's KV pool is empty: nothing is charged, as the routers count its free
    blocks as unlimited until it reports. Charging it as full kept a new replica idle
    until its first report reached the router, a loop or two of Serve's controller
    later, and sent a burst that came first to the replicas already running."""
    used = 1.0 - snapshot.free_kv_blocks / snapshot.total_kv_blocks if snapshot.total_kv_blocks else 0.0
    return snapshot.running_requests + config.decode_kv_weight * used


def choose_decode(
    snapshots: Sequence[ReplicaSnapshot],
    config: RouterConfig,
    blocks_needed: int = 0,
    rng: random.Random | None = None,
) -> RoutingDecision:
    """Pick a decode replica among those with `blocks_needed` free KV blocks.

    If none has room, the one with the most free blocks wins (reason "no-fit"):
    it will queue or preempt, which beats failing the request here.
    """
    if not snapshots:
        raise ValueError("choose_decode: no decode replicas")
    fits = [s for s in snapshots if s.free_kv_blocks >= blocks_needed]
    if not fits:
        best = min(snapshots, key=lambda s: (-s.free_kv_blocks, s.running_requests, s.replica_id))
        costs = [decode_cost(s, config) for s in snapshots]
        return RoutingDecision(best.replica_id, 0, decode_cost(best, config), "no-fit", _candidates(snapshots, costs))
    costs = [decode_cost(s, config) for s in fits]
    i, sampled = _pick(costs, fits, config.temperature, rng)
    return RoutingDecision(fits[i].replica_id, 0, costs[i], "sampled" if sampled else "kv", _candidates(fits, costs))


def choose_local_decode(
    snapshots: Sequence[ReplicaSnapshot],
    matched: dict[str, int],
    config: RouterConfig,
    blocks_needed: int = 0,
    rng: random.Random | None = None,
) -> RoutingDecision:
    """Pick the decode replica that prefills a prompt itself (`router.disaggregation`):
    the one with room holding the longest prefix of it (`matched`: replica → leading
    blocks, from the decode replicas' KV events), the cheaper by `decode_cost` among
    equals (reason "prefix"); with no prefix anywhere, `choose_decode`."""
    fits = [s for s in snapshots if s.free_kv_blocks >= blocks_needed and matched.get(s.replica_id, 0) > 0]
    if not fits:
        return choose_decode(snapshots, config, blocks_needed, rng)
    best = min(fits, key=lambda s: (-matched[s.replica_id], decode_cost(s, config), s.replica_id))
    costs = [decode_cost(s, config) for s in fits]
    return RoutingDecision(best.replica_id, matched[best.replica_id], decode_cost(best, config), "prefix",
                           _candidates(fits, costs))


def _candidates(snapshots: Sequence[ReplicaSnapshot], costs: Sequence[float]) -> tuple[tuple[str, float], ...]:
    return tuple((s.replica_id, float(c)) for s, c in zip(snapshots, costs))


def _pick(
    costs: Sequence[float],
    snapshots: Sequence[ReplicaSnapshot],
    temperature: float,
    rng: random.Random | None,
) -> tuple[int, bool]:
    """Index of the winner; True when it was sampled rather than the argmin."""
    if temperature == 0 or len(costs) == 1:
        # Ties break on replica id so the choice does not depend on list order.
        return min(range(len(costs)), key=lambda i: (costs[i], snapshots[i].replica_id)), False
    rng = rng or random.Random()
    lo = min(costs)
    weights = [math.exp(-(c - lo) / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0], True
