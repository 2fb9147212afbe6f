"""Whether one request is disaggregated: prefilled by the prefill pool and handed off,
or prefilled where it decodes.

A handoff is not free. It costs a prefill call, a lease, a KV transfer and an import
before the second token (tens of ms on one machine), while a decode replica computes
a short prompt in one chunked-prefill step beside its running batch. So a short prompt
is cheaper to prefill locally, and a long one is cheaper to prefill in the prefill pool,
where its compute does not stall the decode batch's steps. `choose_placement` is the
rule the gateway's pipeline (routing/openai/pipeline.py) applies to each pass of a
request, migrations included. It is pure, so it is unit-tested on its own.

The rule (`router.disaggregation`):

- `always`: every request goes through the prefill pool (the default).
- `never`: every request is prefilled on the decode replica that decodes it. This is
  aggregated routing of the same two pools, kept as the baseline to measure against.
- `auto`: prefill locally when the prompt has at most `max_local_prompt_tokens` tokens.
  The decode engine runs such a prompt chunked, within its per-step token budget
  (`engine.max_num_batched_tokens`), so a local prefill never takes a whole step from
  the running batch. The decode replica reports the prompt tokens it prefilled per
  second, and the goodput policy sizes the decode pool for them (docs/autoscaling.md).

What `auto` does not price yet: the decode replica's own prefix match, the decode
pool's batch and TPOT headroom, and the prefill pool's queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DisaggregationConfig(BaseModel):
    """The `router.disaggregation` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["always", "never", "auto"] = "always"
    # `auto`: prompts this long or shorter are prefilled on the decode replica.
    max_local_prompt_tokens: int = Field(256, ge=1)


class Where(StrEnum):
    """Where a request's prompt is computed."""

    REMOTE = "remote"  # the prefill pool, then a KV handoff to decode
    LOCAL = "local"  # the decode replica that decodes it


@dataclass(frozen=True, slots=True)
class Placement:
    where: Where
    reason: str  # "always" | "never" | "short_prompt" | "long_prompt"


def choose_placement(num_prompt_tokens: int, config: DisaggregationConfig) -> Placement:
    """Where to prefill a prompt of `num_prompt_tokens` tokens."""
    if config.mode == "always":
        return Placement(Where.REMOTE, "always")
    if config.mode == "never":
        return Placement(Where.LOCAL, "never")
    if num_prompt_tokens <= config.max_local_prompt_tokens:
        return Placement(Where.LOCAL, "short_prompt")
    return Placement(Where.REMOTE, "long_prompt")
