"""The goodput policy: from both pools' signals and the gateway's, the replica
count each pool should have. Pure code: the Serve controller (cluster/autoscaler.py)
and loadgen's simulator call the same `GoodputPolicy.decide`.

Prefill is sized from prompt-token arrivals plus its backlog against a replica's
prefill speed (the capacity profile, refined by what warm replicas measure), and
raised when the TTFT tail (queue wait included) misses the SLO. Decode is sized
from KV blocks in use and from the largest batch whose step stays within the TPOT
SLO, and raised when the TPOT tail misses it; prompts prefilled on decode (the
router's `disaggregation: auto` or `never`) add their share of a replica's time, at
the profile's prefill speed. Then the guards, in order: min/max, the stabilization
windows, `max_step`, and the shared budget.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from autoscaling import signals as sig
from autoscaling.config import BudgetConfig, CapacityProfile, PoolAutoscaling, SLOConfig
from autoscaling.signals import ReplicaReport

# Latency tails from fewer finished requests than this are not trusted.
MIN_SAMPLES = 5
# A pool scales down only while its latency tail is below this fraction of the SLO.
DOWNSCALE_LATENCY_MARGIN = 0.8
# Measured capacity moves the estimate by this fraction per decision (an EWMA).
REFINE_RATE = 0.3
# Queued prompts are planned to clear in this share of the TTFT SLO.
BACKLOG_DRAIN_SHARE = 0.5
# A TTFT miss counts as queueing (more replicas help) once queue wait is this share of the SLO.
QUEUEING_SHARE = 0.1


@dataclass(frozen=True)
class PoolPolicy:
    """One autoscaled pool: its role (`prefill` or `decode`), settings and costs."""

    role: str
    settings: PoolAutoscaling
    profile: CapacityProfile
    cpus_per_replica: float = 0.0
    gpus_per_replica: float = 0.0


@dataclass(frozen=True)
class PoolState:
    """One pool at one decision: the replicas asked for, and the running ones."""

    target: int
    replicas: tuple[ReplicaReport, ...] = ()


@dataclass(frozen=True)
class _Need:
    """A pool's estimate: `replicas` (None: cannot tell), why, and whether more
    replicas would fix a latency miss (queueing, or batches that can be split)."""

    replicas: float | None
    reason: str
    detail: str
    fixable: bool


@dataclass(frozen=True)
class Decision:
    """`desired` replicas for a pool now `current`; `wanted` is the estimate before
    the guards; `reason` a short code (metrics label), `detail` the numbers."""

    pool: str
    current: int
    desired: int
    wanted: int
    reason: str
    detail: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


class _Stabilizer:
    """A change only after it has been wanted for the whole delay: up to the least
    count wanted over the up window, down to the most wanted over the down window."""

    def __init__(self) -> None:
        self.history: deque[tuple[float, int]] = deque()

    def apply(self, now: float, wanted: int, target: int, up_s: float, down_s: float) -> int:
        self.history.append((now, wanted))
        keep = max(up_s, down_s)
        while len(self.history) > 1 and self.history[1][0] <= now - keep:
            self.history.popleft()
        if wanted > target:
            window = self._window(now, up_s)
            if window is not None and all(w > target for w in window):
                return min(window)
        elif wanted < target:
            window = self._window(now, down_s)
            if window is not None and all(w < target for w in window):
                return max(window)
        return target

    def _window(self, now: float, delay: float) -> list[int] | None:
        """Wanted counts over the last `delay` s; None while history is shorter."""
        if self.history[0][0] > now - delay:
            return None
        start = max((t for t, _ in self.history if t <= now - delay), default=now)
        return [w for t, w in self.history if t >= start]


class GoodputPolicy:
    """Decides every pool at once; call `decide` on each tick (its state is the
    stabilization history and the refined capacity estimates)."""

    def __init__(self, pools: Mapping[str, PoolPolicy], slo: SLOConfig, budget: BudgetConfig | None = None) -> None:
        self.pools = dict(pools)
        self.slo = slo
        self.budget = budget or BudgetConfig()
        self._stabilizers = {name: _Stabilizer() for name in self.pools}
        self._prefill_speed: dict[str, float] = {}  # tokens/s per replica
        self._step_scale: dict[str, float] = {}  # measured / modelled decode step time
        self.last: dict[str, Decision] = {}

    # ------------------------------------------------------------ the decision
    def decide(self, now: float, state: Mapping[str, PoolState], gateway: Mapping[str, float]) -> dict[str, Decision]:
        out: dict[str, Decision] = {}
        for name, pool in self.pools.items():
            st = state.get(name)
            if st is None:
                continue
            wanted, reason, detail = self._estimate(name, pool, st, gateway)
            s = pool.settings
            bounded = min(max(wanted, s.min_replicas), s.max_replicas)
            if bounded != wanted:
                reason, detail = ("min" if bounded > wanted else "max"), f"{detail}; wanted {wanted}"
            desired = self._stabilizers[name].apply(now, bounded, st.target, s.upscale_delay_s, s.downscale_delay_s)
            if desired == st.target and bounded != st.target:
                reason, detail = "stabilizing", f"{detail}; wants {bounded}"
            if abs(desired - st.target) > s.max_step:
                desired = st.target + s.max_step * (1 if desired > st.target else -1)
            out[name] = Decision(name, st.target, desired, wanted, reason, detail)
        out = self._fit_budget(out)
        self.last.update(out)
        return out

    def _estimate(self, name: str, pool: PoolPolicy, st: PoolState, gw: Mapping[str, float]) -> tuple[int, str, str]:
        warm = [r for r in st.replicas if r.age_s >= pool.settings.warmup_s]
        warming = len(warm) < st.target
        if pool.role == "prefill":
            need = self._prefill_need(name, pool, st, warm, gw, warming)
            tail, bound, metric = self._tail(gw, sig.TTFT_MS, warm, sig.REPLICA_TTFT_MS), self.slo.ttft_ms, "ttft"
        else:
            need = self._decode_need(name, pool, st, warm)
            tail, bound, metric = self._tail(gw, sig.TPOT_MS, warm, sig.REPLICA_TPOT_MS), self.slo.tpot_ms, "tpot"
        n = max(1, math.ceil(need.replicas - 1e-9)) if need.replicas is not None else st.target
        q = f"p{round(self.slo.goodput_target * 100)}"
        missed = tail is not None and tail > bound
        if missed and n <= st.target and need.fixable:
            if warming:  # the replicas already coming will change the tail: wait for them
                return (st.target, "warming",
                        f"{metric} {q} {tail:.0f} ms > {bound:.0f} ms; {st.target - len(warm)} warming")
            return st.target + 1, metric, f"{metric} {q} {tail:.0f} ms > SLO {bound:.0f} ms; {need.detail}"
        if n < st.target and need.fixable and tail is not None and tail > DOWNSCALE_LATENCY_MARGIN * bound:
            return st.target, "hold", f"{metric} {q} {tail:.0f} ms near SLO {bound:.0f} ms; {need.detail}"
        return n, need.reason, need.detail

    def _prefill_need(self, name, pool, st, warm, gw, warming: bool) -> _Need:
        arrivals = gw.get(sig.ARRIVAL_PROMPT_TOKENS_PER_S)
        if arrivals is None or arrivals < 0:  # no gateway report: what the replicas finish
            arrivals = sum(r.get(sig.PROMPT_TOKENS_PER_S) or 0.0 for r in st.replicas)
        backlog = sum(r.get(sig.QUEUED_PROMPT_TOKENS) or 0.0 for r in st.replicas)
        waiting = sum(r.get(sig.WAITING) or 0.0 for r in st.replicas)
        waits = [v for r in warm if (v := r.get(sig.QUEUE_WAIT_MS)) is not None]
        # More replicas shorten the queue, not a prompt's own compute: a TTFT miss is
        # theirs to fix only while requests queue.
        fixable = waiting > 0 or max(waits, default=0.0) >= QUEUEING_SHARE * self.slo.ttft_ms
        speed = self._refine_prefill_speed(name, pool, warm, gw)
        if speed is None:
            return _Need(None, "no_capacity", "no profile and no warm replica has measured its speed yet", fixable)
        u = pool.settings.target_utilization
        by_rate = arrivals / (speed * u)
        # A backlog must clear well within the TTFT SLO; while replicas are still coming
        # up it is theirs to clear, and only a higher arrival rate asks for more.
        by_backlog = backlog / (self.slo.ttft_ms / 1e3 * BACKLOG_DRAIN_SHARE) / (speed * u)
        need = by_rate if warming else by_rate + by_backlog
        reason = "queue" if need - by_rate > by_rate else "load"
        return _Need(need, reason, f"{arrivals:.0f} tok/s arriving + {backlog:.0f} queued, "
                                   f"{speed:.0f} tok/s per replica: {need:.2f} replicas", fixable)

    def _refine_prefill_speed(self, name, pool, warm, gw) -> float | None:
        measured = sorted(v for r in warm if (v := r.get(sig.CAPACITY_TOKENS_PER_S)))
        current = self._prefill_speed.get(name)
        if current is None and pool.profile.prefill_model is not None:
            arrivals, tokens = gw.get(sig.ARRIVALS_PER_S) or 0.0, gw.get(sig.ARRIVAL_PROMPT_TOKENS_PER_S) or 0.0
            mean_prompt = tokens / arrivals if arrivals > 0 and tokens > 0 else 256.0
            current = pool.profile.prefill_model.tokens_per_s(mean_prompt)
        if measured:
            m = measured[len(measured) // 2]
            current = m if current is None else (1 - REFINE_RATE) * current + REFINE_RATE * m
        if current is not None:
            self._prefill_speed[name] = current
        return current

    def _decode_need(self, name, pool, st, warm) -> _Need:
        u = pool.settings.target_utilization
        seqs = sum((r.get(sig.RUNNING) or 0) + (r.get(sig.WAITING) or 0) + (r.get(sig.WAITING_IMPORTS) or 0)
                   for r in st.replicas)
        used = sum(r.get(sig.KV_BLOCKS_USED) or 0 for r in st.replicas)
        per_replica = max((r.get(sig.KV_BLOCKS_TOTAL) or 0 for r in st.replicas), default=0)
        by_kv = used / (per_replica * u) if per_replica else 0.0
        # Prompts prefilled here take that share of the replicas' time from decoding
        # (what spreading them over more replicas buys back).
        local = sum(r.get(sig.LOCAL_PROMPT_TOKENS_PER_S) or 0.0 for r in st.replicas)
        speed = self._local_prefill_speed(pool)
        by_prefill = local / (speed * u) if local > 0 and speed else 0.0
        # A smaller batch steps faster; a batch of one cannot be split.
        fixable = seqs >= 2 * max(1, len(st.replicas)) or by_prefill > 0
        prefill = f" + {local:.0f} prompt tok/s prefilled here ({by_prefill:.2f})" if by_prefill else ""
        model = pool.profile.decode_model
        if model is None:
            need = by_kv + by_prefill
            return _Need(need, "kv", f"{used:.0f} KV blocks used of {per_replica:.0f} per replica{prefill}: "
                                     f"{need:.2f} replicas", fixable)
        scale = self._refine_step_scale(name, model, warm, speed)
        batch = model.max_batch_within(self.slo.tpot_ms * u / scale)
        by_batch = seqs / batch
        need = max(by_kv, by_batch) + by_prefill
        detail = (f"{seqs:.0f} sequences, {batch} per replica within TPOT; {used:.0f} KV blocks of "
                  f"{per_replica:.0f}{prefill}: {need:.2f} replicas")
        return _Need(need, "kv" if by_kv > by_batch else "batch", detail, fixable)

    @staticmethod
    def _local_prefill_speed(pool: PoolPolicy) -> float | None:
        """Prompt tokens per second a decode replica computes in its own steps: the
        profile's prefill per-token cost (a step carries no per-call overhead)."""
        model = pool.profile.prefill_model
        return 1e3 / model.b_ms_per_token if model is not None and model.b_ms_per_token > 0 else None

    def _refine_step_scale(self, name, model, warm, local_speed: float | None = None) -> float:
        """How much slower (>1) or faster the warm replicas step than the profile says:
        each one's mean TPOT against the model at the mean batch it was measured at,
        less the share of its time it spent prefilling prompts of its own."""
        def busy_decoding(r: ReplicaReport) -> float:
            local = r.get(sig.LOCAL_PROMPT_TOKENS_PER_S) or 0.0
            return 1.0 - min(0.9, local / local_speed) if local > 0 and local_speed else 1.0

        ratios = sorted(
            t * busy_decoding(r) / (model.c_ms + model.d_ms_per_seq * max(1.0, b))
            for r in warm if (t := r.get(sig.MEAN_TPOT_MS)) and (b := r.get(sig.MEAN_BATCH)) is not None
        )
        scale = self._step_scale.get(name, 1.0)
        if ratios:
            m = min(4.0, max(0.25, ratios[len(ratios) // 2]))
            scale = (1 - REFINE_RATE) * scale + REFINE_RATE * m
        self._step_scale[name] = scale
        return scale

    @staticmethod
    def _tail(gw: Mapping[str, float], key: str, warm: list[ReplicaReport], replica_key: str) -> float | None:
        """The latency tail: the gateway's (end to end) when it has finished enough
        requests, else the worst warm replica's."""
        if (gw.get(sig.FINISHED) or 0) >= MIN_SAMPLES and (v := gw.get(key)) is not None and v >= 0:
            return float(v)
        tails = [v for r in warm if (v := r.get(replica_key)) is not None]
        return max(tails) if tails else None

    # ------------------------------------------------------------ the budget
    def _fit_budget(self, decisions: dict[str, Decision]) -> dict[str, Decision]:
        for limit, cost_of in ((self.budget.cpus, lambda p: p.cpus_per_replica),
                               (self.budget.gpus, lambda p: p.gpus_per_replica)):
            if limit is None:
                continue
            cost = {n: cost_of(self.pools[n]) for n in decisions}
            if sum(d.desired * cost[n] for n, d in decisions.items()) <= limit + 1e-9:
                continue
            fitted = split_budget({n: d.desired for n, d in decisions.items()},
                                  {n: self.pools[n].settings.min_replicas for n in decisions}, cost, limit)
            for n, d in decisions.items():
                if fitted[n] != d.desired:
                    decisions[n] = Decision(n, d.current, fitted[n], d.wanted, "budget",
                                            f"{d.detail}; budget {limit:g} holds {fitted[n]} of {d.desired}")
        return decisions


def split_budget(wanted: Mapping[str, int], floor: Mapping[str, int], cost: Mapping[str, float],
                 limit: float) -> dict[str, int]:
    """Replicas per pool within `limit`: every pool keeps its floor, and what is left
    is split in proportion to what each wants beyond it (largest remainder)."""
    out = {n: min(wanted[n], floor[n]) for n in wanted}
    left = limit - sum(out[n] * cost[n] for n in out)
    extra = {n: (wanted[n] - out[n]) * cost[n] for n in wanted}
    total = sum(extra.values())
    if total <= 0 or left <= 0:
        return out
    shares = {n: min(extra[n], left * extra[n] / total) for n in wanted}
    for n in wanted:
        if cost[n] > 0:
            k = int(shares[n] / cost[n] + 1e-9)
            out[n] += k
            left -= k * cost[n]
        else:
            out[n] = wanted[n]
    for n in sorted(wanted, key=lambda n: shares[n] / cost[n] - int(shares[n] / cost[n] + 1e-9) if cost[n] else 0,
                    reverse=True):
        if out[n] < wanted[n] and cost[n] <= left + 1e-9:
            out[n] += 1
            left -= cost[n]
    return out
