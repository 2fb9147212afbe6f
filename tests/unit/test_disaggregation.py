"""The per-request disaggregation rule (routing/router/disaggregation.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from routing.router.disaggregation import DisaggregationConfig, Placement, Where, choose_placement
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
def test_the_rule(mode, tokens, want):
    assert choose_placement(tokens, DisaggregationConfig(mode=mode, max_local_prompt_tokens=100)) == want


def test_always_is_the_default_and_the_section_is_validated():
    assert RouterConfig().disaggregation.mode == "always"
    assert RouterConfig.model_validate({"disaggregation": {"mode": "auto"}}).disaggregation.max_local_prompt_tokens > 0
    with pytest.raises(ValidationError):
        DisaggregationConfig(mode="sometimes")
    with pytest.raises(ValidationError):
        DisaggregationConfig(max_local_prompt_tokens=0)
