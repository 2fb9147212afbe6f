"""The autoscaling simulator (loadgen/autoscale_sim.py): its cluster model, and the
policies it replays, on a short step trace."""

import json
from dataclasses import astuple

import pytest

from autoscaling.config import CapacityProfile, DecodeProfile, PoolAutoscaling, PrefillProfile, SLOConfig
from loadgen.autoscale_sim import ClusterSim, SimPolicy
from loadgen.distributions import parse_length
from loadgen.planner import Plan
from loadgen.simulator import DecodeModel, LocalPrefill, PrefillModel

pytestmark = pytest.mark.unit

# 1 s per 500-token prompt: one replica serves 1 req/s; decode steps 20 ms + 1 ms per sequence.
PROFILE = CapacityProfile(prefill_model=PrefillProfile(a_ms=0, b_ms_per_token=2.0),
                          decode_model=DecodeProfile(c_ms=20, d_ms_per_seq=1.0))
SLO = SLOConfig(ttft_ms=3000, tpot_ms=100)


def sim(local_prefill: LocalPrefill | None = None, **pool) -> ClusterSim:
    s = PoolAutoscaling(**{"min_replicas": 1, "max_replicas": 6, "max_step": 2, "upscale_delay_s": 2,
                           "downscale_delay_s": 10, "warmup_s": 2, **pool})
    return ClusterSim(PROFILE, SLO, {"prefill": s, "decode": s}, {"prefill": 1, "decode": 1},
                      parse_length("fixed:500"), parse_length("fixed:20"), cold_start_s=5.0, seed=0,
                      local_prefill=local_prefill)


def step(t: float) -> float:
    return 2.5 if 30 <= t < 90 else 0.3  # the burst needs three prefill replicas


def test_the_capacity_model_is_the_planners(tmp_path):
    """`duet plan`'s JSON read as a capacity profile gives back the planner's models,
    and the simulator steps with them."""
    prefill, decode = PrefillModel(0.004, 0.0005), DecodeModel(0.02, 0.001, 64)
    (tmp_path / "plan.json").write_text(json.dumps({"plan": Plan(1, 1, {}, True, prefill, decode).to_dict()}))
    profile = CapacityProfile.load(tmp_path / "plan.json")
    assert astuple(PrefillModel.from_profile(profile.prefill_model)) == pytest.approx(astuple(prefill))
    assert astuple(DecodeModel.from_profile(profile.decode_model)) == pytest.approx(astuple(decode))
    s = sim()
    assert s.prefill.service_s(500) == pytest.approx(1.0) and s.decode.step_s(10) == pytest.approx(0.03)


def test_fixed_at_quiet_load_meets_the_slo():
    run = sim().run(SimPolicy("fixed", "fixed"), lambda t: 0.3, 60)
    summary = run.summary(SLO)
    assert summary["goodput_ratio"] > 0.9 and summary["scaling_actions"] == 0
    assert summary["replica_seconds"] == pytest.approx(120, abs=0.5)


def test_goodput_scales_prefill_for_a_burst_and_back():
    run = sim().run(SimPolicy("goodput", "goodput"), step, 180)
    peak = max(r["prefill_replicas"] for r in run.timeline if 30 <= r["t"] < 90)
    assert peak >= 3
    assert run.timeline[-1]["prefill_replicas"] == 1
    fixed = sim().run(SimPolicy("fixed", "fixed"), step, 180)
    assert run.summary(SLO)["goodput_ratio"] > fixed.summary(SLO)["goodput_ratio"] + 0.3


def test_the_queue_rule_follows_ongoing_requests_with_its_delays():
    run = sim().run(SimPolicy("queue-1", "queue", 1.0), step, 180)
    assert max(r["prefill_replicas"] for r in run.timeline) > 1
    assert run.actions > 0


def test_a_run_is_reproducible():
    a = sim().run(SimPolicy("goodput", "goodput"), step, 120).summary(SLO)
    b = sim().run(SimPolicy("goodput", "goodput"), step, 120).summary(SLO)
    assert a == b


def test_prompts_kept_local_are_prefilled_on_decode_and_never_reach_the_prefill_pool():
    s = sim(LocalPrefill.of_mode("never"))
    run = s.run(SimPolicy("goodput", "goodput"), lambda t: 0.3, 60)
    served = [r for r in run.requests if r.done is not None]
    assert len(served) > 10 and all(r.prefill_start is None for r in served)  # no prefill replica saw one
    assert max(r["prefill_replicas"] for r in run.timeline) == 1
    # alone on its replica a 500-token prompt is one 20 ms + 500 x 2 ms step (within a tick of dt)
    alone = min(r.first_token - r.arrival for r in served)
    assert s.decode.step_s(0) + 1.0 <= alone + 1e-9 <= s.decode.step_s(0) + 1.0 + 2 * s.dt
    # over the limit: the prefill pool as before
    remote = sim(LocalPrefill.of_mode("auto", 499)).run(SimPolicy("fixed", "fixed"), lambda t: 0.3, 60)
    assert all(r.prefill_start is not None for r in remote.requests if r.done is not None)
