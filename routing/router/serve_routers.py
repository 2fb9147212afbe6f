"""KV-aware Ray Serve request routers for the prefill, decode and aggregated pools.

`KVAwarePrefillRouter` is set on the prefill deployment (cluster/app.py) through
``RequestRouterConfig``; Serve instantiates it in every process that holds a
handle to the pool (the gateway replicas, a test driver). For each pending
``prefill(PrefillRequest)`` call it hashes the prompt (engine/hashing.py, with the pool's model fingerprint), asks the
prefix index which replica holds the longest leading run, builds a
`ReplicaSnapshot` per replica and lets the pure policy `routing.router.policy.choose_prefill`
decide. This module only gathers the snapshot and applies the decision.

Where the numbers come from
---------------------------
- **Load.** Each replica's ``record_routing_stats()`` (a `RoutingStats`: queued
  prefill tokens, requests, free KV blocks) reaches every router through the Serve
  controller every ``request_routing_stats_period_s``. That is too stale for a
  burst, so the router also counts what *it* decided, sent and has not seen
  complete (`_plan`, `on_request_routed`, `on_request_completed`): tokens still to
  compute and requests in flight per replica. A report names the requests it
  counts (``request_ids``), so those this router has seen finish since are taken
  off it exactly, whatever the timing. The snapshot takes the larger of the report
  and the local count, so one router never double-counts its own requests, and
  several routers still see each other's load through the replica stats.
- **Cached blocks.** Only from the replicas' KV events (docs/ARCHITECTURE.md: the
  router never guesses; routing never inserts into the index). Two transports,
  chosen by ``router.prefix_index``:

  * ``memory`` (default): every replica keeps a sequence-numbered, compacting
    event log (kvtransfer/events/log.py) and ships it in its routing stats. Each
    router applies the events after its own cursor to its own in-process index.
    Nothing is consumed, so any number of gateway replicas can read the same log,
    and a restarted router replays from the last compaction and is exact again.
  * ``redis``: each replica applies its *own* events to the shared
    `RedisPrefixIndex` (one writer per replica, no duplicate or lost consumers);
    routers only read it. A router restart keeps the whole view.

- **Replica set.** Serve calls `update_replicas` whenever the running set (or a
  replica's stats) changes. A replica that leaves the set, by death or scale-down,
  has its index entries removed, its session-affinity entries dropped and its
  in-flight accounting forgotten. With Redis, a router's first update also removes
  index entries of replicas that are not running any more (a router that was down
  when they went away).

Session affinity: the gateway passes ``x-session-id`` as the request's
``session_id``; the replica the session last used gets a cost bonus (a hint: load and
the imbalance guard still win).

`KVAwareDecodeRouter` chooses a decode replica by free KV blocks and running
sequences (`routing.router.policy.choose_decode`), with the same local in-flight
correction. `KVAwareAggregatedRouter` is its local-prefill choice for the aggregated
pool, whose replicas prefill every prompt themselves.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from autoscaling.placement import DecodeSide, PrefillSide
from engine.hashing import block_hashes
from kvtransfer.events.config import PrefixIndexConfig
from kvtransfer.events.log import KVLogWindow, events_after
from kvtransfer.events.prefix_index import PrefixIndex, make_prefix_index
from kvtransfer.messages import DecodeRequest, PrefillRequest, RoutingStats
from routing.router import view
from routing.router.affinity import SessionAffinity
from routing.router.policy import (
    ReplicaSnapshot,
    RouterConfig,
    RoutingDecision,
    choose_decode,
    choose_local_decode,
    choose_prefill,
)
from telemetry import metrics, tracing

log = logging.getLogger("ray.serve")
_M = TypeVar("_M", PrefillRequest, DecodeRequest)

# How long a finished request is remembered to correct replica reports taken before
# it finished (reports are at most `request_routing_stats_period_s` + a broadcast old),
# and how long a decision may wait to be sent before it no longer counts as load.
_COMPLETED_WINDOW_S = 10.0
# A pick-only choice (`PICK_ONLY`): the ingress request router picks a replica and
# HAProxy sends the request, so this router never sees it sent or completed. It counts
# as load here until the replica's own reports (every `router.stats_period_s`, then a
# controller broadcast) count it instead.
_PICK_ONLY_WINDOW_S = 2.0
# The keyword a `choose_replica` call sets (True) to say it only picks (routing/router/ingress.py).
PICK_ONLY = "duet_pick_only"
# Pick-only decisions kept for the picker to read back (`take_pick`), oldest dropped first.
_PICKS_KEPT = 1024
# Completions of calls not (yet) seen routed, kept to match a late `on_request_routed`.
_DONE_BEFORE_ROUTED_KEPT = 1024


def replica_key(replica_id: ReplicaID) -> str:
    """The id a replica publishes its KV events under (kvtransfer/replica.py)."""
    return f"{replica_id.deployment_id.name}#{replica_id.unique_id}"


@dataclass
class _InFlight:
    """Requests this router sent to one replica that have not completed."""

    tokens: dict[str, int] = field(default_factory=dict)  # internal id -> tokens to compute

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())


@dataclass(frozen=True, slots=True)
class _Planned:
    """A request this router chose a replica for and has not yet seen sent."""

    key: str
    request_id: str | None
    tokens: int  # work it adds there
    counted: int  # what the replica's report counts for it while it is there
    expires_at: float  # monotonic: no longer load here after this (cancelled, or picked only)


class _LoadTracking:
    """Local in-flight accounting shared by both routers (a mixin over RequestRouter)."""

    pool: str  # the pool this router serves: "prefill" or "decode"

    def _init_tracking(self) -> None:
        self._inflight: dict[str, _InFlight] = {}
        self._planned: dict[str, _Planned] = {}  # internal id -> decision not yet sent
        self._sent: dict[str, tuple[str | None, int]] = {}  # internal id -> (request id, as counted there)
        # Per replica: (request id, done at, as counted there) of requests this router
        # saw finish recently. A replica's report names the requests it counts; those
        # this router has seen finish are taken off it (the report is older).
        self._completed: dict[str, deque[tuple[str | None, float, int]]] = {}
        self.decisions: Counter[str] = Counter()
        self._metrics = metrics.Recorder(self.pool, "")
        # Request id -> replica of each call this router sent and has not seen complete:
        # where a forked choice's sibling runs (`_fork_target`).
        self._running_on: dict[str, str] = {}
        # Internal id -> decision of a pick-only choice, until its picker reads it.
        self._picks: OrderedDict[str, RoutingDecision] = OrderedDict()
        # Internal id -> replica of a call that completed before Serve said it was routed.
        # Serve registers a call's done-callback before it reads the replica's accept, and
        # a short call can finish in between (half of a burst of `stats` calls did; a
        # failed import can). Counted as routed after that, it would stay load on its
        # replica for good, and the router would steer around that replica. Cleared by a
        # new decision for the same call (Serve routes a rejected call again).
        self._done_before_routed: OrderedDict[str, str] = OrderedDict()

    def _observe(self, decision: RoutingDecision, parent: dict | None, started: float, matched: int = 0) -> None:
        """Count the decision and trace it as a `route <pool>` span of the request."""
        self.decisions[decision.reason] += 1
        self._metrics.inc(metrics.ROUTER_DECISIONS, reason=decision.reason, replica=decision.replica_id)
        if self.pool == "prefill":
            self._metrics.observe(metrics.ROUTER_OVERLAP, decision.cached_blocks, replica=decision.replica_id)
        if parent is None or not tracing.enabled():
            return
        span = tracing.start_span(f"route {self.pool}", parent, start_time=started, attributes={
            "duet.route.pool": self.pool,
            "duet.route.replica": decision.replica_id,
            "duet.route.reason": decision.reason,
            "duet.route.cost": decision.cost,
            "duet.route.overlap_blocks": decision.cached_blocks,
            "duet.route.longest_match_blocks": matched,
            "duet.route.candidates": [f"{r}={c:.2f}" for r, c in decision.candidates],
        })
        tracing.end_span(span)

    def _load(self, key: str, stats: RoutingStats) -> tuple[int, int]:
        """(prefill tokens, requests) queued on a replica: its last report, less the
        requests in it that this router has since seen finish, and never less than what
        this router has in flight there now, decided-but-not-yet-sent requests included
        (a burst of decisions must see the ones just before it)."""
        reported = set(stats.request_ids)
        stale = [t for rid, _, t in self._completed.get(key, ()) if rid is not None and rid in reported]
        tokens = stats.queued_prefill_tokens - sum(stale)
        requests = stats.num_requests - len(stale)
        local_tokens, local_requests = self._local(key)
        return max(tokens, local_tokens), max(requests, local_requests)

    def _local(self, key: str) -> tuple[int, int]:
        """(tokens, requests) this router sent or decided to send to `key`."""
        flight = self._inflight.get(key)
        tokens = flight.num_tokens if flight else 0
        requests = len(flight.tokens) if flight else 0
        now = time.monotonic()
        for p in self._planned.values():
            if p.key == key and p.expires_at > now:
                tokens += p.tokens
                requests += 1
        return tokens, requests

    def _plan(self, pr: PendingRequest, key: str, tokens: int, counted: int | None = None) -> None:
        """`tokens`: work this request adds; `counted`: what the replica's report
        counts for it while queued (a prefill replica counts the whole prompt)."""
        now = time.monotonic()
        for rid in [rid for rid, p in self._planned.items() if p.expires_at < now]:
            del self._planned[rid]  # decided, never sent (cancelled first), or picked only
        counted = tokens if counted is None else counted
        self._done_before_routed.pop(pr.metadata.internal_request_id, None)  # a new try of that call
        window = _PICK_ONLY_WINDOW_S if pr.kwargs.get(PICK_ONLY) else _COMPLETED_WINDOW_S
        self._planned[pr.metadata.internal_request_id] = _Planned(key, _request_id(pr), tokens, counted,
                                                                  now + window)

    def _remember_pick(self, pr: PendingRequest, decision: RoutingDecision) -> None:
        if pr.kwargs.get(PICK_ONLY):
            self._picks[pr.metadata.internal_request_id] = decision
            while len(self._picks) > _PICKS_KEPT:
                self._picks.popitem(last=False)  # a picker that never asked

    def take_pick(self, internal_request_id: str) -> RoutingDecision | None:
        """The decision of a pick-only choice (the ingress request router's, which tells
        the chosen replica why: its request span says), once."""
        return self._picks.pop(internal_request_id, None)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        rid = pending_request.metadata.internal_request_id
        key = replica_key(replica_id)
        planned = self._planned.pop(rid, None)
        request_id = _request_id(pending_request)
        if request_id is None:
            return  # a call that carries no request (`stats`): no load to count
        if self._done_before_routed.pop(rid, None) == key:
            return  # it already completed there
        tokens = planned.tokens if planned is not None and planned.key == key else 0
        self._inflight.setdefault(key, _InFlight()).tokens[rid] = tokens
        self._sent[rid] = (request_id, planned.counted if planned is not None else 0)
        self._running_on[request_id] = key

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._planned.pop(internal_request_id, None)
        now = time.monotonic()
        request_id, counted = self._sent.pop(internal_request_id, (None, 0))
        key = replica_key(replica_id)
        if request_id is not None and self._running_on.get(request_id) == key:
            del self._running_on[request_id]
        flight = self._inflight.get(key)
        if flight is None or internal_request_id not in flight.tokens:
            self._done_before_routed[internal_request_id] = key  # or never routed (rejected)
            while len(self._done_before_routed) > _DONE_BEFORE_ROUTED_KEPT:
                self._done_before_routed.popitem(last=False)
            return
        flight.tokens.pop(internal_request_id)
        done = self._completed.setdefault(key, deque())
        done.append((request_id, now, counted))
        while done and now - done[0][1] > _COMPLETED_WINDOW_S:
            done.popleft()

    def _route_fork(self, pr: PendingRequest | None, key: str, by_key: dict[str, RunningReplica],
                    trace: dict | None, started: float) -> list[list[RunningReplica]]:
        """Send a forked choice where its sibling runs (one step of work: its last
        prompt token), the others after it should that one refuse the call."""
        self._observe(RoutingDecision(key, 0, 0.0, "fork"), trace, started)
        assert pr is not None  # it carried the message
        self._plan(pr, key, 1)
        return [[by_key[key]], *([r] for k, r in by_key.items() if k != key)]

    def _fork_target(self, req: PrefillRequest | DecodeRequest, candidates: dict[str, RunningReplica]) -> str | None:
        """A forked choice's replica (`PrefillRequest.fork_of`): where this router sent
        its sibling's call, still running, if that replica is a candidate. None: the
        usual decision (the sibling ended, or its replica left)."""
        fork_of = req.fork_of if isinstance(req, PrefillRequest) else None
        key = self._running_on.get(fork_of) if fork_of is not None else None
        return key if key in candidates else None

    def pending(self) -> int:
        """Requests this router decided or sent and has not yet seen complete."""
        return len(self._planned) + sum(len(f.tokens) for f in self._inflight.values())

    def _forget(self, key: str) -> None:
        self._inflight.pop(key, None)
        self._completed.pop(key, None)
        for request_id in [r for r, k in self._running_on.items() if k == key]:
            del self._running_on[request_id]


def _stats(replica: RunningReplica) -> RoutingStats:
    return RoutingStats.from_wire(replica.routing_stats)


def _serving(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The replicas whose engine serves; all of them if none does (a call to one whose
    engine core is being replaced fails at once, and its caller retries or waits)."""
    serving = [r for r in replicas if _stats(r).serving]
    return serving or replicas


class _IndexFollowing:
    """The prefix index of one pool's replicas, kept from their KV events (a mixin over
    `_LoadTracking` and RequestRouter): the replica set, the event-log cursors, and
    removing a replica that left."""

    pool: str
    index_kind: str
    index: PrefixIndex
    block_size: int
    model_fingerprint: str

    def _init_index(self, config: PrefixIndexConfig, block_size: int, model_fingerprint: str) -> None:
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.index_kind = config.prefix_index
        self.index = make_prefix_index(config)
        self._cursors: dict[str, tuple[str, int]] = {}
        self._known: set[str] = set()
        self._synced_once = False
        self._running: list[RunningReplica] = []

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]  # RequestRouter's, after this mixin
        try:
            self._sync(replicas)
        except Exception:  # never break Serve's update path
            log.exception("KV-aware %s router: syncing replicas failed", self.pool)
        view.register(self.pool, self)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A call found the replica dead before the controller said so: route around it now."""
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        self.remove_replica(replica_key(replica_id))

    def _sync(self, replicas: list[RunningReplica]) -> None:
        self._running = list(replicas)
        current = {replica_key(r.replica_id): r for r in replicas}
        gone = self._known - set(current)
        if self.index_kind == "redis" and not self._synced_once and current:
            gone |= self.index.replicas() - set(current)
        for key in gone:
            self.remove_replica(key)
        self._known = set(current)
        self._synced_once = self._synced_once or bool(current)
        for key, r in current.items():
            stats = _stats(r)
            fp = stats.model_fingerprint
            if fp and fp != self.model_fingerprint:
                if self.model_fingerprint:
                    log.error("KV-aware router: replica %s reports fingerprint %r, expected %r; using the replica's",
                              key, fp, self.model_fingerprint)
                self.model_fingerprint = fp
            if self.index_kind == "memory":
                self._apply_log(key, stats.kv_log)

    def _apply_log(self, key: str, window: KVLogWindow | None) -> None:
        if window is None:
            return
        events, restarted = events_after(window, self._cursors.get(key))
        if restarted:
            self.index.remove_replica(key)
        if events:
            self.index.apply(key, events)
        self._cursors[key] = (window.epoch, window.end)

    def remove_replica(self, key: str) -> None:
        """A replica left the pool: forget its blocks, sessions and load."""
        self.index.remove_replica(key)
        self._cursors.pop(key, None)
        self._known.discard(key)
        self._on_removed(key)
        log.info("KV-aware router: replica %s removed from the %s prefix index", key, self.pool)

    def _on_removed(self, key: str) -> None:
        """What else the router forgets about a replica that left."""

    async def _match(self, req: PrefillRequest) -> dict[str, int]:
        """Replica → leading blocks of `req`'s prompt it holds (its salt's chain)."""
        hashes = block_hashes(req.prompt_token_ids, self.block_size, self.model_fingerprint, req.cache_salt)
        if self.index_kind == "redis":
            return await asyncio.to_thread(self.index.match, hashes)
        return self.index.match(hashes)


class KVAwarePrefillRouter(_IndexFollowing, _LoadTracking, RequestRouter):
    """Owns one process's view of the prefill pool: prefix index, affinity, in-flight load."""

    pool = "prefill"

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs as keywords
        self, config: dict | None = None, block_size: int = 16, model_fingerprint: str = "", seed: int | None = None
    ) -> None:
        """`config` is a dumped `RouterConfig`; `block_size` and `model_fingerprint` are
        the pool engine's, so the router hashes prompts as the replicas do."""
        self.config = RouterConfig.model_validate(config or {})
        self._init_index(self.config.of_pool("prefill"), block_size, model_fingerprint)
        self.affinity = SessionAffinity()
        self._rng = random.Random(seed)
        self._init_tracking()

    def _on_removed(self, key: str) -> None:
        self.affinity.remove_replica(key)
        self._forget(key)

    # ------------------------------------------------------------ the decision
    def _snapshot(self, key: str, r: RunningReplica) -> ReplicaSnapshot:
        stats = _stats(r)
        tokens, requests = self._load(key, stats)
        return ReplicaSnapshot(
            replica_id=key,
            queued_prefill_tokens=tokens,
            running_requests=requests,
            free_kv_blocks=stats.kv_blocks_free or 0,
            total_kv_blocks=stats.kv_blocks_total,
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        req = _message(pending_request, "prefill", PrefillRequest)
        if req is None:  # stats(), take_kv_events(), ...: any replica
            return [self._rng.sample(candidate_replicas, len(candidate_replicas))]
        prompt = req.prompt_token_ids
        started = time.monotonic()
        candidate_replicas = _serving(candidate_replicas)
        # Let completion callbacks already queued on this loop run first, so a request
        # that just finished is not counted as load.
        await asyncio.sleep(0)
        matched = await self._match(req)
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        snapshots = [self._snapshot(k, r) for k, r in by_key.items()]
        decision = choose_prefill(
            len(prompt), snapshots, matched, self.config, self.block_size, self.affinity.get(req.session_id),
            self._rng,
        )
        self._observe(decision, req.trace, started, max(matched.values(), default=0))
        self.affinity.record(req.session_id, decision.replica_id)
        to_compute = len(prompt) - decision.cached_blocks * self.block_size
        assert pending_request is not None  # it carried the message
        self._plan(pending_request, decision.replica_id, to_compute, len(prompt))
        rest = [r for k, r in by_key.items() if k != decision.replica_id]
        rest.sort(key=lambda r: self._snapshot(replica_key(r.replica_id), r).queued_prefill_tokens)
        return [[by_key[decision.replica_id]], *([r] for r in rest)]

    async def remote_view(self, req: PrefillRequest) -> PrefillSide:
        """The prefill side of `router.disaggregation: auto`'s price."""
        replicas = self._running
        if not replicas:
            return PrefillSide(0, 0)
        matched = await self._match(req)
        queued = min(self._snapshot(replica_key(r.replica_id), r).queued_prefill_tokens for r in replicas)
        return PrefillSide(queued, max(matched.values(), default=0) * self.block_size)


class KVAwareDecodeRouter(_IndexFollowing, _LoadTracking, RequestRouter):
    """Chooses a decode replica by free KV blocks and running sequences; a prompt to
    prefill there (`router.disaggregation`) goes to the one holding its longest prefix,
    from the decode replicas' KV events."""

    pool = "decode"

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs as keywords
        self, config: dict | None = None, block_size: int = 16, model_fingerprint: str = "", seed: int | None = None
    ) -> None:
        self.config = RouterConfig.model_validate(config or {})
        self._init_index(self.config.of_pool(self.pool), block_size, model_fingerprint)
        self._rng = random.Random(seed)
        self._init_tracking()

    def _on_removed(self, key: str) -> None:
        self._forget(key)

    def _snapshots(self, replicas: list[RunningReplica]) -> list[ReplicaSnapshot]:
        snapshots = []
        for r in replicas:
            key = replica_key(r.replica_id)
            stats = _stats(r)
            _, running = self._load(key, stats)
            pending_blocks, _ = self._local(key)  # sent or about to be, maybe not yet imported
            free = stats.kv_blocks_free if stats.kv_blocks_free is not None else 1 << 30  # unreported: free
            snapshots.append(ReplicaSnapshot(
                replica_id=key,
                running_requests=running,
                free_kv_blocks=max(0, free - pending_blocks),
                total_kv_blocks=stats.kv_blocks_total,
            ))
        return snapshots

    async def _decide(self, req: DecodeRequest | PrefillRequest,
                      replicas: list[RunningReplica]) -> tuple[RoutingDecision, list[ReplicaSnapshot], int]:
        need = -(-len(req.prompt_token_ids) // self.block_size) + 1
        snapshots = self._snapshots(replicas)
        if isinstance(req, PrefillRequest):
            return choose_local_decode(snapshots, await self._match(req), self.config, need, self._rng), snapshots, need
        return choose_decode(snapshots, self.config, need, self._rng), snapshots, need

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        # A handoff's DecodeRequest, or a PrefillRequest to prefill there (router.disaggregation).
        req = (_message(pending_request, "generate", DecodeRequest)
               or _message(pending_request, "generate", PrefillRequest))
        if req is None:
            return [self._rng.sample(candidate_replicas, len(candidate_replicas))]
        started = time.monotonic()
        candidate_replicas = _serving(candidate_replicas)
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        # A replica whose engine is lost is not chosen while another can take the call.
        kept = {k: r for k, r in by_key.items() if k not in req.avoid_replicas}
        if kept:
            by_key, candidate_replicas = kept, list(kept.values())
        fork = self._fork_target(req, by_key)
        if fork is not None:
            return self._route_fork(pending_request, fork, by_key, req.trace, started)
        decision, _, need = await self._decide(req, candidate_replicas)
        self._observe(decision, req.trace, started)
        assert pending_request is not None  # it carried the message
        self._plan(pending_request, decision.replica_id, need)  # tracked in blocks here
        self._remember_pick(pending_request, decision)
        rest = [r for k, r in by_key.items() if k != decision.replica_id]
        return [[by_key[decision.replica_id]], *([r] for r in rest)]

    async def local_view(self, req: PrefillRequest) -> DecodeSide | None:
        """The replica a local prefill of `req` would go to, as the decode side of
        `router.disaggregation: auto`'s price. None with no replica."""
        if not self._running:
            return None
        decision, snapshots, need = await self._decide(req, self._running)
        chosen = next(s for s in snapshots if s.replica_id == decision.replica_id)
        return DecodeSide(decision.cached_blocks * self.block_size, chosen.running_requests,
                          chosen.free_kv_blocks >= need)


class KVAwareAggregatedRouter(KVAwareDecodeRouter):
    """The aggregated pool's router: every call is a `generate(PrefillRequest)` that the
    replica prefills and decodes itself, so it is the decode router's local-prefill
    choice (the replica holding the longest prefix, from the aggregated replicas' own
    KV events; else by running sequences and free blocks), under its own pool name (its
    metrics, its prefix-index keys) and with the same pin for a forked choice."""

    pool = "aggregated"


def _message(pr: PendingRequest | None, method: str, kind: type[_M]) -> _M | None:
    """The typed message of a `method(message)` call, or None for any other call."""
    if pr is None or pr.metadata.call_method != method or not pr.args:
        return None
    msg = pr.args[0]
    return msg if isinstance(msg, kind) else None


def _request_id(pr: PendingRequest) -> str | None:
    """Our request id, from the call's message (`prefill(PrefillRequest)`,
    `generate(DecodeRequest)`); None for other calls."""
    msg = pr.args[0] if pr.args else None
    return msg.request_id if isinstance(msg, (PrefillRequest, DecodeRequest)) else None
