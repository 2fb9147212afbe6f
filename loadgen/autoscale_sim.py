"""Autoscaling policies replayed against a traffic trace, in simulation.

The capacity model is the planner's own (`PrefillModel`, `DecodeModel` in
loadgen/simulator.py, built from the profile): a prefill replica serves prompts one
at a time in a + b x tokens; a decode replica steps its batch in c + d x batch,
every running sequence gaining one token a step. Time moves in
`dt` steps; requests arrive as a Poisson process whose rate follows the trace.
Replicas take `cold_start_s` to come up (they cost from the moment they are asked
for) and a removed replica drains: it takes no new work and goes when empty. With
`local_prefill` (the router's `disaggregation: auto` or `never`) a prompt it keeps
local goes straight to a decode replica, which computes it chunked within its token
budget beside the batch (as loadgen/simulator.py models it), and its replica reports
the prompt tokens it prefilled, as a real decode replica does.

Each pool's replicas report what real replicas report, through the same classes
(autoscaling/signals.py, on the simulation's clock), and the policies are:
- `fixed`: the initial replicas throughout;
- `queue`: Ray Serve's rule, ongoing requests per replica against a target, with
  its up/down delays;
- `goodput`: `autoscaling.policy.GoodputPolicy`, the code the Serve controller runs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from autoscaling.config import BudgetConfig, CapacityProfile, PoolAutoscaling, SLOConfig
from autoscaling.placement import ClusterView
from autoscaling.policy import GoodputPolicy, PoolPolicy, PoolState
from autoscaling.signals import (
    GOODPUT,
    TTFT_MS,
    DecodeSignals,
    GatewaySignals,
    LoadSnapshot,
    PrefillSignals,
    ReplicaReport,
    merge_ingress_reports,
)
from loadgen.distributions import LengthDist
from loadgen.simulator import DecodeModel, LocalPrefill, PrefillModel, view_of


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    prefill_start: float | None = None
    first_token: float | None = None
    done: float | None = None
    left: float = 0.0  # decode tokens still to make (fractional while stepping)
    prompt_left: float = 0.0  # prompt tokens a decode replica still has to prefill (local prefill)
    ingress: Replica | None = None  # the decode replica that took it over HTTP (and decodes it)


@dataclass
class Replica:
    pool: str
    created: float
    ready_at: float
    draining: bool = False
    queue: deque = field(default_factory=deque)  # prefill: FCFS; decode: waiting for a batch slot
    busy_until: float = 0.0  # prefill: when the request at the head is done
    running: list = field(default_factory=list)  # decode: the batch
    signals: object = None
    # Decode: its requests' latencies, as each ingress replica records them (the one
    # topology: the decode replica is the HTTP ingress); the policy merges them.
    ingress: GatewaySignals | None = None

    def empty(self) -> bool:
        return not self.queue and not self.running


@dataclass(frozen=True)
class SimPolicy:
    """What decides the replica counts: `fixed`, `queue` (with its target) or `goodput`."""

    name: str
    kind: str
    target_ongoing_requests: float = 2.0


@dataclass
class SimRun:
    policy: str
    requests: list[Request]
    timeline: list[dict]
    actions: int
    replica_seconds: dict[str, float]

    def summary(self, slo: SLOConfig, burst: tuple[float, float] | None = None) -> dict:
        good = np.array([_good(r, slo) for r in self.requests])
        ttft = np.array([r.first_token - r.arrival for r in self.requests if r.first_token is not None])
        out = {
            "policy": self.policy,
            "requests": len(self.requests),
            "goodput_ratio": float(good.mean()) if len(good) else math.nan,
            "ttft_p90_ms": float(np.percentile(ttft, 90) * 1e3) if len(ttft) else math.nan,
            "replica_seconds": round(sum(self.replica_seconds.values()), 1),
            "replica_seconds_by_pool": {k: round(v, 1) for k, v in self.replica_seconds.items()},
            "scaling_actions": self.actions,
        }
        if burst is not None:
            out["recovery_s"] = self.recovery_s(slo, *burst)
        return out

    def recovery_s(self, slo: SLOConfig, start: float, end: float, window_s: float = 10.0) -> float | None:
        """Seconds from the burst's start until every later `window_s` window of
        arrivals (to the burst's end) meets the goodput target; None: never."""
        last_bad = None
        for t in np.arange(start, end - window_s + 1e-9, 1.0):
            reqs = [r for r in self.requests if t <= r.arrival < t + window_s]
            if reqs and np.mean([_good(r, slo) for r in reqs]) < slo.goodput_target:
                last_bad = t
        if last_bad is None:
            return 0.0
        recovered = last_bad + window_s
        return round(recovered - start, 1) if recovered < end else None


def _good(r: Request, slo: SLOConfig) -> bool:
    if r.done is None or r.first_token is None:
        return False
    if (r.first_token - r.arrival) * 1e3 > slo.ttft_ms:
        return False
    tpot = (r.done - r.first_token) / (r.output - 1) if r.output > 1 else 0.0
    return tpot * 1e3 <= slo.tpot_ms


class ClusterSim:
    """One run: `rate(t)` requests/s for `duration_s`, replicas decided each
    `interval_s` by `policy`."""

    def __init__(self, profile: CapacityProfile, slo: SLOConfig, pools: dict[str, PoolAutoscaling],
                 initial: dict[str, int], input_len: LengthDist, output_len: LengthDist,
                 cold_start_s: float = 20.0, dt: float = 0.05, interval_s: float = 1.0,
                 budget: BudgetConfig | None = None, seed: int = 0,
                 local_prefill: LocalPrefill | None = None) -> None:
        assert profile.prefill_model is not None and profile.decode_model is not None
        self.prefill = PrefillModel.from_profile(profile.prefill_model)
        self.decode = DecodeModel.from_profile(profile.decode_model)
        self.profile, self.slo, self.pools, self.initial = profile, slo, pools, initial
        self.input_len, self.output_len = input_len, output_len
        self.cold_start_s, self.dt, self.interval_s = cold_start_s, dt, interval_s
        self.budget, self.seed = budget, seed
        self.local_prefill = local_prefill

    def run(self, policy: SimPolicy, rate: Callable[[float], float], duration_s: float) -> SimRun:
        rng = np.random.default_rng(self.seed)
        self.now = 0.0
        self.replicas: dict[str, list[Replica]] = {p: [] for p in ("prefill", "decode")}
        for pool, n in self.initial.items():
            for _ in range(n):
                self._add(pool, ready=True)
        goodput = None
        if policy.kind == "goodput":
            goodput = GoodputPolicy({p: PoolPolicy(p, s, self.profile, cpus_per_replica=1.0)
                                     for p, s in self.pools.items()}, self.slo, self.budget)
        queue_since: dict[str, tuple[int, float]] = {}
        requests: list[Request] = []
        timeline: list[dict] = []
        actions = 0
        cost = {p: 0.0 for p in self.replicas}
        next_tick = 0.0
        next_sample = 0.0
        steps = int(round(duration_s / self.dt))
        for i in range(steps):
            self.now = i * self.dt
            for _ in range(rng.poisson(rate(self.now) * self.dt)):
                r = Request(self.now + rng.uniform(0, self.dt), int(self.input_len.sample(rng, 1)[0]),
                            int(self.output_len.sample(rng, 1)[0]))
                requests.append(r)
                r.ingress = self._pick_ingress()
                r.ingress.ingress.arrived(r.prompt)
                if self.local_prefill is not None and self.local_prefill.is_local(r.prompt, self._view()):
                    r.prompt_left = r.prompt
                    self._route_decode(r)
                else:
                    self._route_prefill(r)
            self._step_prefill()
            self._step_decode()
            for pool, reps in self.replicas.items():
                cost[pool] += len(reps) * self.dt
                self.replicas[pool] = [x for x in reps if not (x.draining and x.empty())]
            if self.now >= next_tick:
                next_tick += self.interval_s
                desired = self._decide(policy, goodput, queue_since)
                for pool, n in desired.items():
                    actions += int(n != self._target(pool))
                    self._resize(pool, n)
            if self.now >= next_sample:
                next_sample += 1.0
                ingress = self._ingress_report()
                timeline.append({"t": round(self.now, 2), "rate": rate(self.now),
                                 **{f"{p}_replicas": self._target(p) for p in self.replicas},
                                 "ttft_p90_ms": ingress[TTFT_MS] if ingress[TTFT_MS] >= 0 else None,
                                 "goodput": ingress[GOODPUT] if ingress[GOODPUT] >= 0 else None})
        return SimRun(policy.name, [r for r in requests if r.arrival < duration_s - 60 or r.done is not None],
                      timeline, actions, cost)

    # ------------------------------------------------------------ replicas
    def _add(self, pool: str, ready: bool = False) -> None:
        clock = lambda: self.now  # noqa: E731
        s = PrefillSignals(self.slo.goodput_target, clock=clock) if pool == "prefill" else \
            DecodeSignals(self.slo.goodput_target, clock=clock)
        ingress = None if pool == "prefill" else \
            GatewaySignals(self.slo.ttft_ms, self.slo.tpot_ms, self.slo.goodput_target, clock=clock)
        self.replicas[pool].append(Replica(pool, self.now, self.now if ready else self.now + self.cold_start_s,
                                           signals=s, ingress=ingress))

    def _pick_ingress(self) -> Replica:
        """The decode replica a new request's connection goes to: the least busy ready
        one (what the ingress request router and HAProxy do by load), or, while none
        is ready, the least busy that is not draining."""
        live = self._ready("decode") or [r for r in self.replicas["decode"] if not r.draining]
        return min(live, key=lambda r: len(r.running) + len(r.queue))

    def _ingress_report(self) -> dict[str, float]:
        """The cluster's ingress view: every decode replica's own report, merged as the
        Serve controller merges them (autoscaling/signals.py). A replica that drained
        away takes its window with it."""
        reports = [r.ingress.report() for r in self.replicas["decode"] if r.ingress is not None]
        return merge_ingress_reports(reports, self.slo.goodput_target)

    def _target(self, pool: str) -> int:
        return sum(1 for r in self.replicas[pool] if not r.draining)

    def _resize(self, pool: str, n: int) -> None:
        live = [r for r in self.replicas[pool] if not r.draining]
        for _ in range(n - len(live)):
            self._add(pool)
        if n < len(live):  # drain the newest first (those not ready yet go at once)
            for r in sorted(live, key=lambda r: -r.created)[: len(live) - n]:
                r.draining = True
                if self.now < r.ready_at:
                    r.queue.clear()

    def _ready(self, pool: str) -> list[Replica]:
        return [r for r in self.replicas[pool] if not r.draining and r.ready_at <= self.now]

    def _view(self) -> ClusterView | None:
        """What the router would see now: the least prefill backlog, and the decode
        replica a local prefill would join (None while a pool has no ready replica)."""
        prefills, decodes = self._ready("prefill"), self._ready("decode")
        if not prefills or not decodes:
            return None
        backlog = min(sum(q.prompt for q in r.queue if q.prefill_start is None)
                      + max(0.0, r.busy_until - self.now) / self.prefill.b_s_per_token for r in prefills)
        d = min(decodes, key=lambda r: len(r.running) + len(r.queue))
        return view_of(backlog, len(d.running), len(d.running) + len(d.queue) < self.decode.max_batch)

    # ------------------------------------------------------------ prefill
    def _route_prefill(self, req: Request) -> None:
        ready = self._ready("prefill")
        backlog = lambda r: sum(q.prompt for q in r.queue) + max(0.0, r.busy_until - self.now) * 1e3  # noqa: E731
        min(ready, key=backlog).queue.append(req)

    def _step_prefill(self) -> None:
        for rep in self.replicas["prefill"]:
            if rep.ready_at > self.now:
                continue
            while rep.queue and rep.busy_until <= self.now + self.dt:
                head = rep.queue[0]
                if head.prefill_start is None:
                    head.prefill_start = max(self.now, rep.busy_until, head.arrival)
                    rep.busy_until = head.prefill_start + self.prefill.service_s(head.prompt)
                if rep.busy_until > self.now + self.dt:
                    break
                rep.queue.popleft()
                head.first_token = rep.busy_until
                rep.signals.request(head.arrival, head.prefill_start, head.first_token, head.first_token,
                                    head.prompt, 0)
                head.left = max(0, head.output - 1)
                self._route_decode(head)

    # ------------------------------------------------------------ decode
    def _route_decode(self, req: Request) -> None:
        if req.left <= 0 and req.prompt_left <= 0:
            self._finish(req, req.first_token)
            return
        # It decodes where it came in, unless that replica is draining (a scale-down
        # moves its work to the pool's others).
        if req.ingress is not None and not req.ingress.draining and req.ingress.ready_at <= self.now:
            req.ingress.queue.append(req)
            return
        ready = self._ready("decode")
        min(ready, key=lambda r: len(r.running) + len(r.queue)).queue.append(req)

    def _step_decode(self) -> None:
        for rep in self.replicas["decode"]:
            if rep.ready_at > self.now:
                continue
            while rep.queue and len(rep.running) < self.decode.max_batch:
                rep.running.append(rep.queue.popleft())
            if not rep.running:
                continue
            decoding = [r for r in rep.running if r.prompt_left <= 0]
            chunks = self._chunks([r for r in rep.running if r.prompt_left > 0], len(decoding))
            steps = self.dt / (self.decode.step_s(len(decoding)) + self.prefill.b_s_per_token * sum(chunks.values()))
            still = []
            for req in rep.running:
                if req.prompt_left > 0:
                    req.prompt_left -= chunks.get(id(req), 0) * steps
                    if req.prompt_left > 0:
                        still.append(req)
                        continue
                    req.first_token = self.now + self.dt  # the prompt's last chunk samples it
                    req.left = max(0, req.output - 1)
                    rep.signals.prefilled_here(req.prompt, req.first_token)
                else:
                    req.left -= steps
                if req.left <= 0:
                    self._finish(req, self.now + self.dt)
                    rep.signals.request(req.first_token, req.done, req.output)
                else:
                    still.append(req)
            rep.running = still

    def _chunks(self, prefilling: list[Request], decoding: int) -> dict[int, int]:
        """Prompt tokens per step for each local prefill (by id): the token budget
        less one per decoding sequence, in arrival order."""
        if not prefilling:
            return {}
        assert self.local_prefill is not None
        budget = self.local_prefill.token_budget
        left = max(budget - decoding, 0) if decoding else budget
        chunks = {}
        for r in prefilling:
            chunks[id(r)] = take = min(math.ceil(r.prompt_left), left)
            left -= take
        return chunks

    def _finish(self, req: Request, at: float) -> None:
        req.done = at
        tpot = (req.done - req.first_token) / (req.output - 1) if req.output > 1 else None
        req.ingress.ingress.finished(req.first_token - req.arrival, tpot, ok=True)

    # ------------------------------------------------------------ decisions
    def _decide(self, policy: SimPolicy, goodput: GoodputPolicy | None, since: dict) -> dict[str, int]:
        if policy.kind == "fixed":
            return {}
        if policy.kind == "queue":
            return {p: self._serve_queue_rule(p, policy.target_ongoing_requests, since) for p in self.pools}
        states = {}
        for pool in self.pools:
            reports = tuple(ReplicaReport(f"{pool}{i}", self.now - r.ready_at, self._report(r))
                            for i, r in enumerate(self._ready(pool)))
            states[pool] = PoolState(self._target(pool), reports)
        decisions = goodput.decide(self.now, states, self._ingress_report())
        return {p: d.desired for p, d in decisions.items()}

    def _report(self, r: Replica) -> dict[str, float]:
        if r.pool == "prefill":
            waiting = [q for q in r.queue if q.prefill_start is None]
            return r.signals.report(LoadSnapshot(queued_prefill_tokens=sum(q.prompt for q in waiting),
                                                 num_waiting=len(waiting), num_running=len(r.queue) - len(waiting)))
        total = 1 << 20  # KV is not the limit in this model: the batch's step time is
        return r.signals.report(LoadSnapshot(num_running=len(r.running), num_waiting=len(r.queue),
                                             kv_blocks_total=total, kv_blocks_free=total), waiting_imports=0)

    def _serve_queue_rule(self, pool: str, target: float, since: dict) -> int:
        """Ray Serve's default policy: replicas = ongoing requests / target, acted on
        once the wish has lasted the up (or down) delay, within min/max."""
        s = self.pools[pool]
        current = self._target(pool)
        ongoing = sum(len(r.queue) + len(r.running) for r in self.replicas[pool])
        want = min(max(math.ceil(ongoing / target), s.min_replicas), s.max_replicas)
        if want == current:
            since.pop(pool, None)
            return current
        direction = 1 if want > current else -1
        prev = since.get(pool)
        if prev is None or prev[0] != direction:
            since[pool] = (direction, self.now)
            prev = since[pool]
        delay = s.upscale_delay_s if direction > 0 else s.downscale_delay_s
        if self.now - prev[1] >= delay:
            since.pop(pool, None)
            return want
        return current
