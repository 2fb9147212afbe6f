"""Seeded discrete-event simulation of a disaggregated cluster, for the planner.

Model (the same one planner.py fits):
- Prefill pool: P replicas, each a single FCFS server; a request goes to the replica
  that frees up first (what a load-aware router approximates). Service time
  a + b * prompt_tokens. The first token leaves with the prefill result, so
  TTFT = prefill queueing + service.
- Decode pool: D replicas, each a continuous batch. A request joins the replica with
  the fewest sequences `transfer_s` after its prefill ends; every step takes
  c + d * batch_size and gives each running sequence one token; at most `max_batch`
  run at once, the rest wait. TPOT = (E2EL - TTFT) / (output_tokens - 1).
- Prefill on decode (`LocalPrefill`, the router's `disaggregation: auto` or `never`):
  each arrival is placed by the router's own rule (`choose_placement`; under `auto`
  priced from the simulated pools at that moment). A prompt kept local skips the
  prefill pool and joins a decode replica at arrival. The decode engine computes it
  chunked, beside the running batch: each step spends at most `token_budget` tokens,
  one per decoding sequence first, the rest on waiting prompts in arrival order, and a
  prompt token costs what it costs the prefill pool (the prefill model's b; its a,
  the per-call overhead, is not paid). The first token leaves with the step that
  finishes the prompt.
Not modelled: prefix-cache hits, chunked prefill of remote prompts, preemption,
network jitter.

PrefillModel and DecodeModel are loadgen's one capacity model: the planner fits them,
and the autoscaling simulator (autoscale_sim.py) builds them from a capacity profile
(`from_profile`: the same fit, in milliseconds) and steps its replicas with them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autoscaling.placement import ClusterView, DisaggregationConfig, Where, choose_placement
from loadgen.arrivals import inter_arrival_gaps
from loadgen.distributions import LengthDist
from loadgen.metrics import SLO

if TYPE_CHECKING:
    from autoscaling.config import DecodeProfile, PrefillProfile


@dataclass(frozen=True)
class PrefillModel:
    """Per-replica prefill service time: a + b * prompt_tokens (seconds)."""

    a_s: float
    b_s_per_token: float

    @classmethod
    def from_profile(cls, profile: PrefillProfile) -> PrefillModel:
        """A capacity profile's `prefill_model` (what `duet plan` writes, in ms)."""
        return cls(profile.a_ms / 1e3, profile.b_ms_per_token / 1e3)

    def service_s(self, tokens: np.ndarray | float) -> np.ndarray | float:
        return self.a_s + self.b_s_per_token * tokens


@dataclass(frozen=True)
class DecodeModel:
    """Per-replica decode step time: c + d * batch_size (seconds), i.e. TPOT(batch)."""

    c_s: float
    d_s_per_seq: float
    max_batch: int = 256

    @classmethod
    def from_profile(cls, profile: DecodeProfile) -> DecodeModel:
        """A capacity profile's `decode_model` (what `duet plan` writes, in ms)."""
        return cls(profile.c_ms / 1e3, profile.d_ms_per_seq / 1e3, profile.max_batch)

    def step_s(self, batch: int) -> float:
        return self.c_s + self.d_s_per_seq * batch

    def max_tokens_per_s(self) -> float:
        return self.max_batch / self.step_s(self.max_batch)


@dataclass(frozen=True)
class LocalPrefill:
    """Which prompts are prefilled on the decode replica that decodes them: the
    router's own rule (`router.disaggregation`, mode `never` or `auto`, applied by
    `choose_placement`), and the decode engine's per-step token budget
    (`engine.max_num_batched_tokens`).

    Under `auto` each arrival is priced as the router prices it, from a `ClusterView`
    of the simulated pools at that moment (`view_of`): the prefill pool's least
    backlog, the sequences on the decode replica a local prefill would join and
    whether it has room. No prefix cache is modelled, so every prompt token is
    uncached on both sides."""

    rule: DisaggregationConfig
    token_budget: int = 512

    def __post_init__(self) -> None:
        if self.rule.mode == "always" or self.token_budget < 1:
            raise ValueError("LocalPrefill needs disaggregation mode never or auto, and token_budget >= 1")

    @classmethod
    def of_mode(cls, mode: str, max_prompt_tokens: int = 256, token_budget: int = 512,
                **prices: float) -> LocalPrefill | None:
        """The model of `router.disaggregation` `mode` (None for `always`: every prompt
        through the prefill pool); `prices` are `DisaggregationConfig`'s knobs."""
        if mode == "always":
            return None
        return cls(DisaggregationConfig(mode=mode, max_local_prompt_tokens=max_prompt_tokens, **prices),
                   token_budget)

    @property
    def max_prompt_tokens(self) -> float:
        """The longest prompt ever computed locally."""
        return math.inf if self.rule.mode == "never" else self.rule.max_local_prompt_tokens

    def within_limit(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """Per prompt, whether it may be computed locally at all (its length alone)."""
        return np.asarray(prompt_tokens) <= self.max_prompt_tokens

    def is_local(self, prompt_tokens: int, view: ClusterView | None) -> bool:
        """The router's choice for one prompt, given what the pools look like now."""
        return choose_placement(int(prompt_tokens), self.rule, view).where is Where.LOCAL


def view_of(prefill_backlog_tokens: float, decode_running: int, decode_fits: bool) -> ClusterView:
    """What the router would know in a simulation without a prefix cache."""
    return ClusterView(prefill_queued_tokens=int(prefill_backlog_tokens), prefill_cached_tokens=0,
                       decode_cached_tokens=0, decode_running=decode_running, decode_fits=decode_fits)


@dataclass(frozen=True)
class Traffic:
    """Target load: open-loop arrivals at `rate` req/s with a length mix."""

    rate: float
    input_len: LengthDist
    output_len: LengthDist
    burstiness: float = 1.0


@dataclass
class SimResult:
    """Per-request simulated latencies (seconds); tpot is NaN for 1-token outputs."""

    arrival: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    e2el: np.ndarray
    output_tokens: np.ndarray
    local: np.ndarray | None = None  # per request: prefilled on decode (LocalPrefill)

    @property
    def duration_s(self) -> float:
        return float(np.nanmax(self.arrival + self.e2el) - np.min(self.arrival))

    def good(self, slo: SLO) -> np.ndarray:
        ok = np.ones(len(self.ttft), bool)
        if slo.ttft_ms is not None:
            ok &= self.ttft <= slo.ttft_ms / 1000
        if slo.tpot_ms is not None:
            ok &= np.nan_to_num(self.tpot, nan=0.0) <= slo.tpot_ms / 1000
        if slo.e2el_ms is not None:
            ok &= self.e2el <= slo.e2el_ms / 1000
        return ok

    def goodput_ratio(self, slo: SLO, among: np.ndarray | None = None) -> float:
        """The share of requests meeting `slo`; of those `among` selects, if given
        (1.0 when it selects none)."""
        good = self.good(slo) if among is None else self.good(slo)[among]
        return float(good.mean()) if len(good) else 1.0

    def summary(self, slo: SLO | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2el", self.e2el)):
            v = v[~np.isnan(v)]
            for p in (50, 90, 99):
                out[f"{name}_p{p}_ms"] = float(np.percentile(v, p) * 1000) if len(v) else math.nan
            out[f"{name}_mean_ms"] = float(v.mean() * 1000) if len(v) else math.nan
        if slo is not None and not slo.empty:
            out["goodput_ratio"] = self.goodput_ratio(slo)
            out["goodput_rps"] = float(self.good(slo).sum() / self.duration_s)
        if self.local is not None:
            out["local_prefill_fraction"] = float(self.local.mean())
        return out


class _DecodePool:
    """The decode pool's replicas, stepped event by event up to a given time, so that a
    placement decided at an arrival sees the pool as it is then.

    A request joins at a time (its first token's, or its arrival's if it is prefilled
    here) needing `tokens_left[i]` decode steps; one with `prompt_left[i]` > 0 is
    prefilled here first, chunked within `token_budget` tokens a step, each prompt token
    costing `prefill_s_per_token`. A request joins the replica with the fewest sequences
    at its join time."""

    def __init__(self, model: DecodeModel, n_replicas: int, tokens_left: np.ndarray, token_budget: int,
                 prefill_s_per_token: float) -> None:
        n = len(tokens_left)
        self.model, self.n = model, n_replicas
        self.tokens_left = np.asarray(tokens_left, int)
        self.prompt_left = np.zeros(n, int)
        self.budget, self.prefill_s_per_token = token_budget, prefill_s_per_token
        self.first, self.finish = np.full(n, np.nan), np.full(n, np.nan)
        self.running: list[dict[int, int]] = [{} for _ in range(n_replicas)]  # request -> decode steps left
        self.waiting: list[deque[int]] = [deque() for _ in range(n_replicas)]
        self.chunks: list[dict[int, int]] = [{} for _ in range(n_replicas)]  # this step's prompt tokens per request
        self.busy = [False] * n_replicas
        self.events: list[tuple[float, int, int]] = []  # (time, kind 0=step end 1=join, replica or request)

    def join(self, i: int, t: float, prompt_tokens: int = 0) -> None:
        self.first[i] = self.finish[i] = t  # a request with nothing left finishes when it joins
        self.prompt_left[i] = prompt_tokens
        if self.tokens_left[i] > 0 or prompt_tokens > 0:
            heapq.heappush(self.events, (t, 1, i))

    def choice(self) -> int:
        """The replica a request joining now would join."""
        return min(range(self.n), key=lambda k: len(self.running[k]) + len(self.waiting[k]))

    def num_running(self, r: int) -> int:
        return len(self.running[r])

    def has_room(self, r: int) -> bool:
        return len(self.running[r]) + len(self.waiting[r]) < self.model.max_batch

    def advance(self, until: float) -> None:
        """Every join and step end up to `until`."""
        while self.events and self.events[0][0] <= until:
            t, kind, x = heapq.heappop(self.events)
            if kind == 1:
                r = self.choice()
                self.waiting[r].append(x)
                if not self.busy[r]:
                    self._start_step(r, t)
            else:
                self._end_step(x, t)

    def _start_step(self, r: int, t: float) -> None:
        running, waiting = self.running[r], self.waiting[r]
        while waiting and len(running) < self.model.max_batch:
            j = waiting.popleft()
            running[j] = int(self.tokens_left[j])
        if not running:
            self.busy[r] = False
            return
        decoding = sum(1 for j in running if self.prompt_left[j] == 0)
        left = max(self.budget - decoding, 0) if decoding else self.budget
        chunks = self.chunks[r] = {}
        for j in running:  # insertion order: arrival order
            if self.prompt_left[j] > 0 and left > 0:
                chunks[j] = take = min(int(self.prompt_left[j]), left)
                left -= take
        self.busy[r] = True
        step = self.model.step_s(decoding) + self.prefill_s_per_token * sum(chunks.values())
        heapq.heappush(self.events, (t + step, 0, r))

    def _end_step(self, r: int, t: float) -> None:
        batch = self.running[r]
        for j in list(batch):
            if self.prompt_left[j] == 0:  # decoded one token this step
                batch[j] -= 1
            elif j in self.chunks[r]:
                self.prompt_left[j] -= self.chunks[r][j]
                if self.prompt_left[j] > 0:
                    continue
                self.first[j] = t  # the prompt's last chunk samples the first token
            else:
                continue
            if batch[j] == 0:
                self.finish[j] = t
                del batch[j]
        self._start_step(r, t)


def simulate(
    prefill: PrefillModel,
    decode: DecodeModel | None,
    n_prefill: int,
    n_decode: int,
    traffic: Traffic,
    num_requests: int = 1000,
    seed: int = 0,
    transfer_s: float = 0.0,
    local_prefill: LocalPrefill | None = None,
) -> SimResult:
    """Simulate `num_requests` requests; `decode=None` simulates prefill only (TPOT 0;
    with `local_prefill`, the prompts it keeps local get no times: NaN, and `auto`
    decides by length alone, having no decode pool to look at).

    `local_prefill` None is `router.disaggregation: always`: every prompt is prefilled
    by the prefill pool, and its KV reaches decode `transfer_s` later. Arrivals are
    taken in order: each is placed, then served by the prefill pool's replica that
    frees up first (FCFS) or joins decode at once."""
    if n_prefill < 1 or (decode is not None and n_decode < 1):
        raise ValueError("replica counts must be >= 1")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(inter_arrival_gaps(traffic.rate, num_requests, traffic.burstiness, seed))
    n_in = traffic.input_len.sample(rng, num_requests).astype(float)
    n_out = traffic.output_len.sample(rng, num_requests)
    service = np.asarray(prefill.service_s(n_in), float)
    budget = local_prefill.token_budget if local_prefill is not None else 0
    pool = None if decode is None else _DecodePool(decode, n_decode, n_out - 1, budget, prefill.b_s_per_token)
    free_at = [0.0] * n_prefill  # a heap of prefill replica free times
    local = np.zeros(num_requests, bool)
    first = np.full(num_requests, np.nan)
    for i, t in enumerate(arrival):
        if local_prefill is not None:
            view = None
            if pool is not None:
                pool.advance(t)
                r = pool.choice()
                backlog_tokens = max(0.0, free_at[0] - t) / prefill.b_s_per_token
                view = view_of(backlog_tokens, pool.num_running(r), pool.has_room(r))
            local[i] = local_prefill.is_local(int(n_in[i]), view)
        if local[i]:
            if pool is not None:
                pool.join(i, t, int(n_in[i]))
            continue
        done = max(t, heapq.heappop(free_at)) + service[i]
        heapq.heappush(free_at, done)
        first[i] = done
        if pool is not None:
            pool.join(i, done + transfer_s)
    if pool is None:
        end = first
    else:
        pool.advance(math.inf)
        end = pool.finish
        first = np.where(local, pool.first, first)
    ttft = first - arrival
    e2el = end - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out > 1, (e2el - ttft) / (n_out - 1), np.nan)
    if decode is None:
        tpot = np.where(n_out > 1, np.where(~local, 0.0, np.nan), np.nan)
    return SimResult(arrival, ttft, tpot, e2el, n_out, None if local_prefill is None else local)
