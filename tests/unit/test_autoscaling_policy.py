"""The goodput policy on synthetic signal series (autoscaling/policy.py): which pool
it scales and why, and its guards (stabilization, steps, budget, cold starts)."""

import random

import pytest

from autoscaling import signals as sig
from autoscaling.config import BudgetConfig, CapacityProfile, DecodeProfile, PoolAutoscaling, PrefillProfile, SLOConfig
from autoscaling.policy import GoodputPolicy, PoolPolicy, PoolState, split_budget
from autoscaling.signals import ReplicaReport

pytestmark = pytest.mark.unit

SLO = SLOConfig(ttft_ms=1000, tpot_ms=100, goodput_target=0.9)
# 1,000 prompt tokens/s per prefill replica; decode steps 20 ms + 2 ms per sequence,
# so 80 ms (the TPOT SLO x 0.8 utilization) holds 30 sequences.
PROFILE = CapacityProfile(prefill_model=PrefillProfile(a_ms=0, b_ms_per_token=1.0),
                          decode_model=DecodeProfile(c_ms=20, d_ms_per_seq=2.0))


def settings(**kw) -> PoolAutoscaling:
    base = dict(min_replicas=1, max_replicas=8, max_step=8, upscale_delay_s=0, downscale_delay_s=0, warmup_s=5)
    return PoolAutoscaling(**{**base, **kw})


def policy(prefill=None, decode=None, budget=None, profile=PROFILE) -> GoodputPolicy:
    return GoodputPolicy({
        "prefill": PoolPolicy("prefill", prefill or settings(), profile, cpus_per_replica=1),
        "decode": PoolPolicy("decode", decode or settings(), profile, cpus_per_replica=1),
    }, SLO, budget)


def prefill_pool(n, queued=0.0, age=60.0, **values) -> PoolState:
    reps = tuple(ReplicaReport(f"p{i}", age, {sig.QUEUED_PROMPT_TOKENS: queued / n, **values}) for i in range(n))
    return PoolState(n, reps)


def decode_pool(n, seqs=0.0, blocks_used=0.0, blocks_total=1000.0, age=60.0, **values) -> PoolState:
    reps = tuple(ReplicaReport(f"d{i}", age, {sig.RUNNING: seqs / n, sig.KV_BLOCKS_USED: blocks_used / n,
                                               sig.KV_BLOCKS_TOTAL: blocks_total, **values}) for i in range(n))
    return PoolState(n, reps)


def gateway(tok_s=0.0, rps=1.0, ttft=200.0, tpot=50.0, finished=50) -> dict:
    return {sig.ARRIVAL_PROMPT_TOKENS_PER_S: tok_s, sig.ARRIVALS_PER_S: rps, sig.TTFT_MS: ttft,
            sig.TPOT_MS: tpot, sig.FINISHED: finished}


def test_a_prefill_heavy_step_scales_prefill_not_decode():
    p = policy()
    quiet = p.decide(0, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=4)}, gateway(tok_s=300, rps=1))
    assert (quiet["prefill"].desired, quiet["decode"].desired) == (1, 1)
    # 2,000 prompt tokens/s of long prompts, few of them: 2000 / (1000 x 0.8) -> 3.
    burst = p.decide(1, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=4)}, gateway(tok_s=2000, rps=1))
    assert burst["prefill"].desired == 3 and burst["prefill"].reason == "load"
    assert burst["decode"].desired == 1


def test_a_decode_heavy_step_scales_decode_not_prefill():
    p = policy()
    d = p.decide(0, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=70)}, gateway(tok_s=200, rps=4))
    assert d["decode"].desired == 3 and d["decode"].reason == "batch"  # 70 / 30 per replica
    assert d["prefill"].desired == 1


def test_kv_blocks_in_use_scale_decode():
    d = policy().decide(0, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=5, blocks_used=950)},
                        gateway())
    assert d["decode"].desired == 2 and d["decode"].reason == "kv"


def test_a_missed_ttft_with_few_requests_still_scales_prefill():
    """Two long prompts queued: few ongoing requests (a queue-length rule sees nothing),
    but the TTFT tail, queue wait included, misses the SLO."""
    p = policy(profile=CapacityProfile())  # no capacity model: only the latency can tell
    state = {"prefill": prefill_pool(1, queued=3000, **{sig.WAITING: 1, sig.RUNNING: 1}), "decode": decode_pool(1)}
    d = p.decide(0, state, gateway(tok_s=100, rps=0.1, ttft=4000))
    assert d["prefill"].desired == 2 and d["prefill"].reason == "ttft"
    assert d["decode"].desired == 1


def test_a_backlog_alone_scales_prefill():
    d = policy().decide(0, {"prefill": prefill_pool(1, queued=1500), "decode": decode_pool(1)}, gateway(tok_s=0))
    # 1,500 tokens to clear in half the TTFT SLO: 3,000 tok/s over 800 per replica.
    assert d["prefill"].desired == 4 and d["prefill"].reason == "queue"


def test_steady_load_near_a_threshold_does_not_oscillate():
    p = policy(prefill=settings(upscale_delay_s=5, downscale_delay_s=20))
    rng = random.Random(0)
    target, changes = 2, 0
    for tick in range(600):  # 10 minutes at one decision a second
        load = 1600 * (1 + rng.uniform(-0.05, 0.05))  # 2.0 +- 5% replicas' worth
        d = p.decide(tick, {"prefill": prefill_pool(target), "decode": decode_pool(1)}, gateway(tok_s=load))
        if d["prefill"].desired != target:
            changes += 1
            target = d["prefill"].desired
    assert changes <= 1, changes


def test_no_downscale_that_would_put_the_rest_over_the_threshold():
    p = policy()
    # 1.1 replicas' worth of load on 2 replicas: one replica would be at 88% > 80%.
    d = p.decide(0, {"prefill": prefill_pool(2), "decode": decode_pool(1)}, gateway(tok_s=880))
    assert d["prefill"].desired == 2
    d = p.decide(1, {"prefill": prefill_pool(2), "decode": decode_pool(1)}, gateway(tok_s=700))
    assert d["prefill"].desired == 1


def test_no_downscale_while_requests_queue_and_the_latency_tail_is_near_the_slo():
    queueing = prefill_pool(3, **{sig.QUEUE_WAIT_MS: 300})
    d = policy().decide(0, {"prefill": queueing, "decode": decode_pool(1)}, gateway(tok_s=100, ttft=900))
    assert d["prefill"].desired == 3 and d["prefill"].reason == "hold"


def test_a_ttft_miss_without_queueing_adds_no_replica():
    """Long prompts' own compute over the SLO: another replica would not shorten it."""
    no_queue = prefill_pool(1, **{sig.QUEUE_WAIT_MS: 20, sig.WAITING: 0})
    d = policy().decide(0, {"prefill": no_queue, "decode": decode_pool(1)}, gateway(tok_s=100, ttft=2500))
    assert d["prefill"].desired == 1 and d["prefill"].reason == "load"


def test_stabilization_windows_and_max_step():
    p = policy(prefill=settings(upscale_delay_s=10, downscale_delay_s=30, max_step=2))
    state = lambda n: {"prefill": prefill_pool(n), "decode": decode_pool(1)}  # noqa: E731
    for t in range(10):
        d = p.decide(t, state(1), gateway(tok_s=4000))  # wants 5
        assert d["prefill"].desired == 1 and d["prefill"].reason == "stabilizing"
    d = p.decide(10, state(1), gateway(tok_s=4000))
    assert d["prefill"].desired == 3  # at most max_step at once
    for t in range(11, 40):
        assert p.decide(t, state(3), gateway(tok_s=100))["prefill"].desired == 3
    assert p.decide(41, state(3), gateway(tok_s=100))["prefill"].desired == 1


def test_min_and_max_bound_the_estimate():
    p = policy(prefill=settings(min_replicas=2, max_replicas=3))
    assert p.decide(0, {"prefill": prefill_pool(2), "decode": decode_pool(1)}, gateway(tok_s=0))["prefill"].desired == 2
    d = p.decide(1, {"prefill": prefill_pool(2), "decode": decode_pool(1)}, gateway(tok_s=10_000))["prefill"]
    assert d.desired == 3 and d.reason == "max"


def test_the_budget_is_split_in_proportion_to_what_each_pool_wants():
    p = policy(budget=BudgetConfig(cpus=6))
    # Prefill wants 5 (4,000 tok/s), decode wants 5 (150 sequences); 6 CPUs hold 3 + 3.
    d = p.decide(0, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=150)}, gateway(tok_s=4000))
    assert (d["prefill"].desired, d["decode"].desired) == (3, 3)
    assert d["prefill"].reason == "budget" and d["decode"].reason == "budget"
    assert split_budget({"a": 6, "b": 2}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, 5) == {"a": 4, "b": 1}
    assert split_budget({"a": 3, "b": 3}, {"a": 1, "b": 1}, {"a": 2, "b": 1}, 100) == {"a": 3, "b": 3}


def test_cold_start_samples_are_ignored():
    p = policy(profile=CapacityProfile())
    # A replica still warming up reports a terrible TTFT and a tiny speed: no action.
    bad = {sig.REPLICA_TTFT_MS: 9000, sig.QUEUE_WAIT_MS: 8000, sig.CAPACITY_TOKENS_PER_S: 10}
    cold = {"prefill": prefill_pool(1, age=1.0, **bad), "decode": decode_pool(1)}
    d = p.decide(0, cold, {})
    assert d["prefill"].desired == 1 and d["prefill"].reason == "no_capacity"
    # Warm, the same samples count.
    warm = {"prefill": prefill_pool(1, age=30.0, **{sig.REPLICA_TTFT_MS: 9000, sig.QUEUE_WAIT_MS: 8000}),
            "decode": decode_pool(1)}
    assert p.decide(1, warm, {})["prefill"].desired == 2


def test_a_latency_miss_waits_for_replicas_already_coming():
    p = policy()
    queueing = prefill_pool(1, **{sig.WAITING: 3})
    state = {"prefill": PoolState(2, queueing.replicas), "decode": decode_pool(1)}  # one pending
    d = p.decide(0, state, gateway(tok_s=100, ttft=3000))
    assert d["prefill"].desired == 2 and d["prefill"].reason == "warming"


def test_measured_prefill_speed_refines_the_profile():
    p = policy()
    slow = {sig.CAPACITY_TOKENS_PER_S: 250.0}  # the profile says 1,000
    for t in range(20):
        d = p.decide(t, {"prefill": prefill_pool(1, **slow), "decode": decode_pool(1)}, gateway(tok_s=400))
    assert d["prefill"].desired == 2  # 400 / (250 x 0.8)


def test_measured_decode_steps_refine_the_batch_that_fits_the_tpot():
    p = policy()
    # The replica steps twice as slowly as the profile says at the batch it measured at
    # (20 + 2 x 10 = 40 ms modelled, 80 ms measured): 80 ms holds (80/2 - 20) / 2 = 10.
    slow = {sig.MEAN_TPOT_MS: 80.0, sig.MEAN_BATCH: 10.0}
    for t in range(30):
        d = p.decide(t, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=25, **slow)}, gateway(tpot=60))
    assert d["decode"].desired == 3  # 25 / 10 (30 per replica by the profile alone: 1)


def test_prompts_prefilled_on_decode_add_their_share_of_the_replicas_time():
    # 20 sequences fit one replica (30 within TPOT); 1,200 prompt tokens/s computed on
    # decode at the profile's 1,000 tok/s take 1,200 / (1,000 x 0.8) = 1.5 replicas more.
    d = policy().decide(0, {"prefill": prefill_pool(1), "decode": decode_pool(
        2, seqs=20, **{sig.LOCAL_PROMPT_TOKENS_PER_S: 600.0})}, gateway())
    assert d["decode"].desired == 3  # ceil(20 / 30 + 1.5)
    assert "prefilled here" in d["decode"].detail
    none = policy().decide(0, {"prefill": prefill_pool(1), "decode": decode_pool(2, seqs=20)}, gateway())
    assert none["decode"].desired == 1


def test_a_replica_slowed_by_its_own_prefills_is_not_taken_for_a_slow_stepper():
    # Measured TPOT 80 ms at batch 10 against the profile's 40 ms: all of it explained by
    # half its time going to prompts prefilled here (500 tok/s at 1,000 tok/s), so the
    # step model stays as profiled and 25 sequences still fit one replica's batch.
    p = policy()
    busy = {sig.MEAN_TPOT_MS: 80.0, sig.MEAN_BATCH: 10.0, sig.LOCAL_PROMPT_TOKENS_PER_S: 500.0}
    for t in range(30):
        d = p.decide(t, {"prefill": prefill_pool(1), "decode": decode_pool(1, seqs=25, **busy)}, gateway(tpot=60))
    assert d["decode"].desired == 2  # ceil(25 / 30 + 500 / 800)
