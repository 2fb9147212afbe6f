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
  a prompt the rule keeps local skips the prefill pool and joins a decode replica at
  arrival. The decode engine computes it chunked, beside the running batch: each step
  spends at most `token_budget` tokens, one per decoding sequence first, the rest on
  waiting prompts in arrival order, and a prompt token costs what it costs the prefill
  pool (the prefill model's b; its a, the per-call overhead, is not paid). The first
  token leaves with the step that finishes the prompt.
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
    """Which prompts are prefilled on the decode replica that decodes them, and the
    decode engine's per-step token budget (`engine.max_num_batched_tokens`).
    `router.disaggregation` `auto` is `max_prompt_tokens` = its `max_local_prompt_tokens`;
    `never` is every prompt (math.inf)."""

    max_prompt_tokens: float
    token_budget: int = 512

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1 or self.token_budget < 1:
            raise ValueError("max_prompt_tokens and token_budget must be >= 1")

    def is_local(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return np.asarray(prompt_tokens) <= self.max_prompt_tokens


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


def _simulate_prefill(arrival: np.ndarray, service: np.ndarray, n_replicas: int) -> np.ndarray:
    """Prefill end times; arrivals are sorted, so FCFS order is index order."""
    free_at = [0.0] * n_replicas  # a heap of replica free times
    done = np.empty_like(arrival)
    for i, (t, s) in enumerate(zip(arrival, service)):
        f = heapq.heappop(free_at)
        done[i] = max(t, f) + s
        heapq.heappush(free_at, done[i])
    return done


def _simulate_decode(join: np.ndarray, tokens_left: np.ndarray, model: DecodeModel, n_replicas: int,
                     prompt: np.ndarray | None = None, local: LocalPrefill | None = None,
                     prefill_s_per_token: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(first token, finish) times of requests that join decode at `join` needing
    `tokens_left` steps after their first token. A request with `prompt` tokens > 0
    is prefilled here first (`local`'s token budget, `prefill_s_per_token` each); the
    others came with their first token (their first time is left at `join`)."""
    first, finish = join.copy(), join.copy()  # requests with nothing left finish when they join
    prompt_left = np.zeros(len(join), int) if prompt is None else prompt.astype(int)
    budget = local.token_budget if local is not None else 0
    order = [int(i) for i in np.argsort(join, kind="stable") if tokens_left[i] > 0 or prompt_left[i] > 0]
    running: list[dict[int, int]] = [{} for _ in range(n_replicas)]  # request -> decode steps left
    waiting: list[deque[int]] = [deque() for _ in range(n_replicas)]
    chunks: list[dict[int, int]] = [{} for _ in range(n_replicas)]  # this step's prompt tokens per request
    busy = [False] * n_replicas
    events: list[tuple[float, int, int]] = []  # (time, kind 0=step end 1=join, replica or request)
    for i in order:
        heapq.heappush(events, (float(join[i]), 1, i))

    def start_step(r: int, t: float) -> None:
        while waiting[r] and len(running[r]) < model.max_batch:
            j = waiting[r].popleft()
            running[r][j] = int(tokens_left[j])
        if not running[r]:
            busy[r] = False
            return
        decoding = sum(1 for j in running[r] if prompt_left[j] == 0)
        left = max(budget - decoding, 0) if decoding else budget
        chunks[r] = {}
        for j in running[r]:  # insertion order: arrival order
            if prompt_left[j] > 0 and left > 0:
                chunks[r][j] = take = min(int(prompt_left[j]), left)
                left -= take
        busy[r] = True
        step = model.step_s(decoding) + prefill_s_per_token * sum(chunks[r].values())
        heapq.heappush(events, (t + step, 0, r))

    while events:
        t, kind, x = heapq.heappop(events)
        if kind == 1:
            r = min(range(n_replicas), key=lambda k: len(running[k]) + len(waiting[k]))
            waiting[r].append(x)
            if not busy[r]:
                start_step(r, t)
            continue
        batch = running[x]
        for j in list(batch):
            if prompt_left[j] == 0:  # decoded one token this step
                batch[j] -= 1
            elif j in chunks[x]:
                prompt_left[j] -= chunks[x][j]
                if prompt_left[j] > 0:
                    continue
                first[j] = t  # the prompt's last chunk samples the first token
            else:
                continue
            if batch[j] == 0:
                finish[j] = t
                del batch[j]
        start_step(x, t)
    return first, finish


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
    with `local_prefill`, the prompts it keeps local get no times: NaN).

    `local_prefill` None is `router.disaggregation: always`: every prompt is prefilled
    by the prefill pool, and its KV reaches decode `transfer_s` later."""
    if n_prefill < 1 or (decode is not None and n_decode < 1):
        raise ValueError("replica counts must be >= 1")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(inter_arrival_gaps(traffic.rate, num_requests, traffic.burstiness, seed))
    n_in = traffic.input_len.sample(rng, num_requests).astype(float)
    n_out = traffic.output_len.sample(rng, num_requests)
    local = np.zeros(num_requests, bool) if local_prefill is None else local_prefill.is_local(n_in)
    remote = ~local
    first = np.full(num_requests, np.nan)
    first[remote] = _simulate_prefill(arrival[remote], np.asarray(prefill.service_s(n_in[remote]), float), n_prefill)
    if decode is None:
        end = first
    else:
        join = np.where(local, arrival, first + transfer_s)
        prompt = np.where(local, n_in, 0)
        local_first, end = _simulate_decode(join, n_out - 1, decode, n_decode, prompt, local_prefill,
                                            prefill.b_s_per_token)
        first = np.where(local, local_first, first)
    ttft = first - arrival
    e2el = end - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out > 1, (e2el - ttft) / (n_out - 1), np.nan)
    if decode is None:
        tpot = np.where(n_out > 1, np.where(remote, 0.0, np.nan), np.nan)
    return SimResult(arrival, ttft, tpot, e2el, n_out, None if local_prefill is None else local)
