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
- `auto`: prices both places from what the routers know (`ClusterView`) and takes the
  cheaper, in milliseconds:

      local  = U_local × local_ms_per_token × (1 + decode_interference × R)
      remote = handoff_ms + (Q + U_remote) × prefill_ms_per_token

  `U_local` is the prompt's tokens past the longest prefix a decode replica holds (its
  KV events: a multi-turn conversation it decoded before), `R` the sequences running
  there (each step of a local prefill delays them all: the interference term), `Q` the
  least prompt tokens queued on a prefill replica, `U_remote` the prompt past the
  prefill pool's longest prefix, and `handoff_ms` the measured cost of a handoff (the
  prefill call, lease, transfer and import before the second token). Before that, hard
  limits: a local prefill computes at most `max_local_prompt_tokens` tokens, and never
  on a decode replica that is full (running at `max_num_seqs`, or without free blocks
  for the prompt). Without a view (no router has reported yet) `auto` falls back to
  the prompt's length against `max_local_prompt_tokens`.

The decode engine runs a local prompt chunked within its per-step token budget
(`engine.max_num_batched_tokens`), so a local prefill never takes a whole step from
the running batch. The decode replica reports the prompt tokens it prefilled per
second, and the goodput policy sizes the decode pool for them (docs/autoscaling.md).
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
    # `auto`: at most this many prompt tokens are computed on a decode replica.
    max_local_prompt_tokens: int = Field(256, ge=1)
    # `auto`'s prices (module docstring). Defaults: SmolLM2-135M fp32 on 2 CPU cores
    # (deploy/profiles/smollm2-135m-cpu.json's prefill ms per token; the handoff's
    # measured cost at concurrency 1, docs/benchmarks.md).
    handoff_ms: float = Field(30.0, ge=0)
    prefill_ms_per_token: float = Field(3.5, gt=0)
    local_ms_per_token: float = Field(3.5, gt=0)
    decode_interference: float = Field(0.05, ge=0)


class Where(StrEnum):
    """Where a request's prompt is computed."""

    REMOTE = "remote"  # the prefill pool, then a KV handoff to decode
    LOCAL = "local"  # the decode replica that decodes it


@dataclass(frozen=True, slots=True)
class PrefillSide:
    """The prefill pool's side of a pass's price (its router's view): the least prompt
    tokens queued on a replica, and the longest prefix of this prompt a replica holds."""

    queued_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeSide:
    """The side of the decode replica a local prefill would run on: the prefix of this
    prompt it holds (tokens), its running sequences, and whether it has room."""

    cached_tokens: int
    running: int
    fits: bool


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What the routers know when a pass is placed: the prefill pool's least queue and
    longest prefix of this prompt, and the decode replica a local prefill would go to
    (the one holding the longest prefix of it, else the decode router's choice)."""

    prefill_queued_tokens: int
    prefill_cached_tokens: int
    decode_cached_tokens: int
    decode_running: int
    decode_fits: bool  # a free slot in its batch and free blocks for the prompt


@dataclass(frozen=True, slots=True)
class Placement:
    where: Where
    # always | never | short_prompt | long_prompt | decode_full | cheaper_local | cheaper_remote
    reason: str
    local_ms: float | None = None  # `auto`'s prices, when it had a view
    remote_ms: float | None = None


def choose_placement(num_prompt_tokens: int, config: DisaggregationConfig,
                     view: ClusterView | None = None) -> Placement:
    """Where to prefill a prompt of `num_prompt_tokens` tokens."""
    if config.mode == "always":
        return Placement(Where.REMOTE, "always")
    if config.mode == "never":
        return Placement(Where.LOCAL, "never")
    if view is None:
        if num_prompt_tokens <= config.max_local_prompt_tokens:
            return Placement(Where.LOCAL, "short_prompt")
        return Placement(Where.REMOTE, "long_prompt")
    local_tokens = max(0, num_prompt_tokens - view.decode_cached_tokens)
    remote_tokens = max(0, num_prompt_tokens - view.prefill_cached_tokens)
    local_ms = local_tokens * config.local_ms_per_token * (1 + config.decode_interference * view.decode_running)
    remote_ms = config.handoff_ms + (view.prefill_queued_tokens + remote_tokens) * config.prefill_ms_per_token
    prices = {"local_ms": round(local_ms, 1), "remote_ms": round(remote_ms, 1)}
    if not view.decode_fits:
        return Placement(Where.REMOTE, "decode_full", **prices)
    if local_tokens > config.max_local_prompt_tokens:
        return Placement(Where.REMOTE, "long_prompt", **prices)
    if local_ms <= remote_ms:
        return Placement(Where.LOCAL, "cheaper_local", **prices)
    return Placement(Where.REMOTE, "cheaper_remote", **prices)
