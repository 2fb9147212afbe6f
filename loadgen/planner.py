"""Capacity planner: fit each pool's capacity model on measured sweeps, then find
the fewest prefill and decode replicas whose simulated goodput meets the target.

Inputs are `duet bench serve` results (report.py point objects):
- a prefill-heavy sweep (long input, 1 output token): at the lightest load, each
  request's service time is its TTFT less its queueing, recovered from the send
  times by Lindley's recursion over FCFS replicas; a + b * tokens is fitted on those
  (for results without send times, on TTFT, with the intercept corrected for the
  mean wait an M/G/1 queue per replica predicts at that load);
- a decode-heavy sweep (short input, long output): per point, the mean batch per
  replica (Little's law: completed req/s x mean decode time / replicas) against
  mean TPOT gives step time c + d * batch.

With prefill on decode (`LocalPrefill`: the router's `disaggregation: auto` or
`never`), the prefill pool is sized on the prompts it still gets, and a local prompt's
TTFT counts against the decode pool, where it is computed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.metrics import SLO
from loadgen.simulator import DecodeModel, LocalPrefill, PrefillModel, SimResult, Traffic, simulate


@dataclass(frozen=True)
class PlanTarget:
    """What the plan must meet: a fraction `goodput_target` of requests meets every
    SLO at the traffic's rate and length mix."""

    traffic: Traffic
    slo: SLO
    goodput_target: float = 0.9

    def __post_init__(self) -> None:
        if self.slo.empty:
            raise ValueError("the plan needs at least one SLO (ttft, tpot or e2el)")
        if not 0 < self.goodput_target <= 1:
            raise ValueError("goodput_target must be in (0, 1]")


@dataclass
class Plan:
    """The recommendation and the simulation that supports it."""

    prefill_replicas: int
    decode_replicas: int
    predicted: dict[str, float]
    feasible: bool
    prefill_model: PrefillModel
    decode_model: DecodeModel
    notes: list[str] = field(default_factory=list)
    transfer_s: float = 0.0
    local_prefill: LocalPrefill | None = None  # None: every prompt through the prefill pool

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_replicas": self.prefill_replicas,
            "decode_replicas": self.decode_replicas,
            "feasible": self.feasible,
            "predicted": self.predicted,
            "prefill_model": {"a_ms": self.prefill_model.a_s * 1e3,
                              "b_ms_per_token": self.prefill_model.b_s_per_token * 1e3},
            "decode_model": {"c_ms": self.decode_model.c_s * 1e3, "d_ms_per_seq": self.decode_model.d_s_per_seq * 1e3,
                             "max_batch": self.decode_model.max_batch},
            "transfer_ms": self.transfer_s * 1e3,
            "local_prefill": None if self.local_prefill is None else {
                "rule": self.local_prefill.rule.model_dump(),
                "max_prompt_tokens": self.local_prefill.max_prompt_tokens,
                "token_budget": self.local_prefill.token_budget},
            "notes": self.notes,
        }


def _completed(point: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in point["requests"] if r["outcome"] == "completed" and r.get("ttft_ms") is not None]


def service_times(rows: list[dict[str, Any]], replicas: int = 1) -> np.ndarray:
    """Per-request service seconds with the queueing taken out, in `rows` order.

    Lindley's recursion over `replicas` FCFS servers: a request starts when it is
    sent or when the first replica frees, whichever is later, and is served until
    its first token. A request that finished before a replica was free by this
    account (the server batched it with another) gets 0, and the replica stays busy."""
    order = sorted(range(len(rows)), key=lambda i: rows[i]["start_ms"])
    free = [-math.inf] * replicas
    out = np.zeros(len(rows))
    for i in order:
        sent = rows[i]["start_ms"] / 1e3
        done = sent + rows[i]["ttft_ms"] / 1e3
        start = max(sent, heapq.heappop(free))
        out[i] = max(0.0, done - start)
        heapq.heappush(free, max(done, start))
    return out


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b*x with a, b >= 0."""
    if x.std() < 1.0:  # one prompt length: a and b are not separable; assume a = 0
        return 0.0, float(y.mean() / x.mean())
    b, a = (float(v) for v in np.polyfit(x, y, 1))
    if a < 0:
        a, b = 0.0, float((x @ y) / (x @ x))
    if b < 0:
        a, b = float(y.mean()), 0.0
    return a, b


def fit_prefill(points: list[dict[str, Any]], replicas: int = 1) -> PrefillModel:
    """Service time a + b*tokens from the lightest-loaded point of a prefill sweep."""
    usable = [p for p in points if len(_completed(p)) >= 2]
    if not usable:
        raise ValueError("prefill sweep has no point with >= 2 completed requests")
    p = min(usable, key=lambda q: q["metrics"]["request_throughput"])
    rows = _completed(p)
    x = np.array([r["prompt_tokens"] for r in rows], float)
    if all("start_ms" in r for r in rows):
        return PrefillModel(*_line(x, service_times(rows, replicas)))
    y = np.array([r["ttft_ms"] for r in rows], float) / 1e3
    a, b = _line(x, y)
    # Without send times: in FCFS a request's wait does not depend on its own length,
    # so the regression's intercept is a + E[W]: remove the M/G/1 mean wait
    # W = lam E[S^2] / (2 (1 - rho)) from it (fixed point, a few steps).
    lam = p["metrics"]["request_throughput"] / replicas
    a_fit, a_true = a, a
    for _ in range(50):
        s = a_true + b * x
        rho = lam * s.mean()
        if rho >= 0.95:
            break
        a_true = max(0.0, a_fit - lam * (s**2).mean() / (2 * (1 - rho)))
    return PrefillModel(a_true, b)


def fit_decode(points: list[dict[str, Any]], replicas: int = 1, max_batch: int = 256) -> DecodeModel:
    """Step time c + d*batch by least squares over the points of a decode sweep."""
    batch, tpot = [], []
    for p in points:
        rows = [r for r in _completed(p) if r.get("tpot_ms") is not None]
        if not rows:
            continue
        decode_s = np.mean([(r["e2el_ms"] - r["ttft_ms"]) / 1e3 for r in rows])
        batch.append(p["metrics"]["request_throughput"] * decode_s / replicas)
        tpot.append(np.mean([r["tpot_ms"] for r in rows]) / 1e3)
    if len(batch) < 2 or np.ptp(batch) < 0.5:
        raise ValueError("decode sweep needs >= 2 points at different batch sizes (sweep --concurrency)")
    d, c = (float(v) for v in np.polyfit(batch, tpot, 1))
    if c < 0:
        c, d = 0.0, float(np.dot(batch, tpot) / np.dot(batch, batch))
    if d < 0:
        c, d = float(np.mean(tpot)), 0.0
    return DecodeModel(c, d, max_batch)


def _shortfalls(sim: SimResult, pre_slo: SLO, dec_slo: SLO) -> tuple[float, float]:
    """(prefill pool's, decode pool's) goodput ratios on what each pool decides: the
    TTFT of the prompts the prefill pool computes; the TPOT of all, and the TTFT of the
    prompts computed on decode."""
    local = sim.local if sim.local is not None else np.zeros(len(sim.ttft), bool)
    pre = sim.goodput_ratio(pre_slo, among=~local) if not pre_slo.empty else 1.0
    dec = sim.goodput_ratio(dec_slo) if not dec_slo.empty else 1.0
    if not pre_slo.empty and local.any():
        dec = min(dec, sim.goodput_ratio(pre_slo, among=local))
    return pre, dec


def recommend(
    prefill: PrefillModel,
    decode: DecodeModel,
    target: PlanTarget,
    num_requests: int = 2000,
    seed: int = 0,
    max_replicas: int = 64,
    transfer_s: float = 0.0,
    local_prefill: LocalPrefill | None = None,
) -> Plan:
    """Fewest replicas per pool meeting the goodput target in simulation.

    Each pool is sized first against its own SLO (TTFT depends only on prefill, or on
    decode for a prompt `local_prefill` keeps there), then the joint simulation adds a
    replica to the weaker pool until the joint goodput meets the target or
    `max_replicas` is reached (then infeasible)."""
    tr, slo, g = target.traffic, target.slo, target.goodput_target
    run = lambda p, d: simulate(prefill, decode, p, d, tr, num_requests, seed, transfer_s,  # noqa: E731
                                local_prefill)
    pre_slo = SLO(ttft_ms=slo.ttft_ms)
    dec_slo = SLO(tpot_ms=slo.tpot_ms)
    # The prefill pool's share of the traffic: every prompt, or at least those too long
    # to be computed locally (under `auto` the simulation prices the rest).
    lengths = tr.input_len.sample(np.random.default_rng(seed), num_requests).astype(float)
    remote = lengths if local_prefill is None else lengths[~local_prefill.within_limit(lengths)]
    work_s = float(np.sum(prefill.service_s(remote))) / len(lengths) if len(remote) else 0.0
    p = max(1, math.ceil(tr.rate * work_s))
    while p < max_replicas and not pre_slo.empty and _shortfalls(
            simulate(prefill, None, p, 0, tr, num_requests, seed, local_prefill=local_prefill),
            pre_slo, SLO())[0] < g:
        p += 1
    d = max(1, math.ceil(tr.rate * max(tr.output_len.mean - 1, 0) / decode.max_tokens_per_s()))
    sim = run(p, d)
    while d < max_replicas and _shortfalls(sim, pre_slo, dec_slo)[1] < g:
        d += 1
        sim = run(p, d)
    while sim.goodput_ratio(slo) < g and (p < max_replicas or d < max_replicas):
        weak_pre, weak_dec = _shortfalls(sim, pre_slo, dec_slo)
        if (weak_pre <= weak_dec and p < max_replicas) or d >= max_replicas:
            p += 1
        else:
            d += 1
        sim = run(p, d)
    feasible = sim.goodput_ratio(slo) >= g
    notes = [] if feasible else [f"goodput target {g} not reached with {max_replicas} replicas per pool"]
    return Plan(p, d, sim.summary(slo), feasible, prefill, decode, notes, transfer_s, local_prefill)
