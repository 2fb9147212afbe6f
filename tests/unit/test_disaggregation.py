"""The per-request disaggregation rule (autoscaling/placement.py)."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from autoscaling.placement import ClusterView, DisaggregationConfig, Placement, Where, choose_placement
from routing.router.policy import RouterConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("mode, tokens, want", [
    ("always", 10, Placement(Where.REMOTE, "always")),
    ("always", 10_000, Placement(Where.REMOTE, "always")),
    ("never", 10, Placement(Where.LOCAL, "never")),
    ("never", 10_000, Placement(Where.LOCAL, "never")),
    ("auto", 1, Placement(Where.LOCAL, "short_prompt")),
    ("auto", 100, Placement(Where.LOCAL, "short_prompt")),  # at the limit: local
    ("auto", 101, Placement(Where.REMOTE, "long_prompt")),
])
def test_the_rule_without_a_view(mode, tokens, want):
    assert choose_placement(tokens, DisaggregationConfig(mode=mode, max_local_prompt_tokens=100)) == want


def test_always_is_the_default_and_the_section_is_validated():
    assert RouterConfig().disaggregation.mode == "always"
    assert RouterConfig.model_validate({"disaggregation": {"mode": "auto"}}).disaggregation.max_local_prompt_tokens > 0
    with pytest.raises(ValidationError):
        DisaggregationConfig(mode="sometimes")
    with pytest.raises(ValidationError):
        DisaggregationConfig(max_local_prompt_tokens=0)


AUTO = DisaggregationConfig(mode="auto", max_local_prompt_tokens=256)
IDLE = ClusterView(prefill_queued_tokens=0, prefill_cached_tokens=0, decode_cached_tokens=0, decode_running=0,
                   decode_fits=True)


def place(tokens: int, **view) -> Placement:
    return choose_placement(tokens, AUTO, dataclasses.replace(IDLE, **view))


def test_a_short_prompt_is_computed_where_it_decodes():
    p = place(64)
    assert (p.where, p.reason) == (Where.LOCAL, "cheaper_local")
    assert p.local_ms == 64 * 3.5 and p.remote_ms == 30 + 64 * 3.5


def test_a_long_prompt_goes_to_the_prefill_pool():
    assert (place(2000).where, place(2000).reason) == (Where.REMOTE, "long_prompt")


def test_a_prompt_whose_prefix_the_decode_replica_holds_is_computed_there():
    # 1,500 tokens: past the local limit, unless decode holds all but 100 of them (an
    # earlier turn of the conversation), even with a batch running there.
    assert place(1500, decode_cached_tokens=0).where is Where.REMOTE
    p = place(1500, decode_cached_tokens=1400, decode_running=6)
    assert (p.where, p.reason) == (Where.LOCAL, "cheaper_local")
    # ... but not when the prefill pool holds the same prefix and the batch is large.
    p = place(1500, decode_cached_tokens=1400, prefill_cached_tokens=1400, decode_running=32)
    assert (p.where, p.reason) == (Where.REMOTE, "cheaper_remote")


def test_a_busy_decode_batch_sends_prompts_to_an_idle_prefill_pool():
    assert place(200, decode_running=0).where is Where.LOCAL
    p = place(200, decode_running=16)
    assert (p.where, p.reason) == (Where.REMOTE, "cheaper_remote") and p.local_ms > p.remote_ms


def test_a_full_decode_replica_computes_nothing_locally():
    p = place(16, decode_fits=False)
    assert (p.where, p.reason) == (Where.REMOTE, "decode_full")


def test_a_long_prefill_queue_keeps_prompts_on_decode():
    assert place(200, decode_running=16).where is Where.REMOTE
    p = place(200, decode_running=16, prefill_queued_tokens=4000)
    assert (p.where, p.reason) == (Where.LOCAL, "cheaper_local") and p.remote_ms > 14_000
