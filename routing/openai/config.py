"""Settings of the OpenAI gateway (the cluster config's `gateway:` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """Where the gateway listens and how much it admits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    num_cpus: float = Field(0.25, gt=0)
    # What carries HTTP from the client to the ingress replicas (the replicas that
    # decode, each with the gateway inside). "haproxy": Serve's HAProxy ingress (Ray
    # 2.60 direct ingress), which forwards each connection to the replica's own HTTP
    # server, and asks the ingress request router (routing/router/ingress.py) where each
    # POST goes. "proxy": Serve's Python HTTP proxy, which relays every streamed chunk
    # from the replica over Ray and picks the replica by load alone; it is kept for a
    # Ray cluster that cannot turn HAProxy on, because that switch is cluster-wide
    # (every Serve app of the cluster moves to it). Either way the Ray cluster decides:
    # `duet serve` starts its Ray with HAProxy; a cluster it joins, or the Helm chart's,
    # must run with RAY_SERVE_ENABLE_HA_PROXY=1 (the chart sets it).
    ingress: Literal["proxy", "haproxy"] = "haproxy"
    # Requests inside the gateway at once; beyond this a new one gets a 429.
    max_pending_requests: int = Field(256, ge=1)
    # API keys: this file (one per line) and/or DUET_API_KEYS; none at all = an open gateway.
    api_keys_file: str | None = None
    # Whether /metrics needs a key too (/health and /ready never do).
    metrics_require_key: bool = False
    # Per key: requests in flight, and tokens (prompt + max_tokens) per minute. None: no limit.
    max_in_flight_per_key: int | None = Field(None, ge=1)
    tokens_per_minute_per_key: int | None = Field(None, ge=1)
    # Most completion tokens one request may ask for (400 above it; the default when a
    # request leaves max_tokens unset). None: up to the model's context.
    max_tokens: int | None = Field(None, ge=1)
    # Most sequences one request may ask for, as choices (`n`) or as completion
    # candidates (`best_of`): 400 above it. Each is its own sequence through the pools,
    # so n choices cost n requests' decode (their prompt's KV is forked, computed once).
    max_n: int = Field(8, ge=1, le=128)
    # How the model writes tool calls (routing/openai/tools.py): `hermes` (a chat
    # template that renders `tools` and writes calls in <tool_call> tags), `duet` (any
    # other: duet describes the tools and parses a JSON object), `auto` (from the template).
    tool_format: Literal["auto", "duet", "hermes"] = "auto"
    # A Jinja chat template file used instead of the checkpoint's (None: the checkpoint's).
    chat_template: str | None = None
    # A larger request body is refused with 413 before it is parsed.
    max_body_bytes: int = Field(4 << 20, ge=1024)
    # A decode replica that dies mid-stream: continue the request elsewhere (re-prefill
    # prompt + tokens so far, resume at the next token) at most this many times.
    max_migrations: int = Field(1, ge=0, le=8)
    # A prefill replica that dies before answering: try another one this many times.
    prefill_retries: int = Field(1, ge=0, le=8)
    # A retry no prefill replica answers within this long (the pool has none left, and
    # Serve would queue it until one is replaced: 10-20 s) is cancelled, and the decode
    # replica prefills the prompt itself.
    prefill_retry_wait_s: float = Field(3.0, gt=0)
    # Header fields and their total bytes per request (431 beyond).
    max_headers: int = Field(100, ge=8)
    max_header_bytes: int = Field(32 << 10, ge=1024)
    # An ingress replica being stopped finishes its streams for at most this long.
    drain_timeout_s: float = Field(60.0, ge=0)
    # A request still running after this long ends with a 504 (its KV and leases freed).
    request_timeout_s: float | None = Field(600.0, gt=0)
    # Whose KV a request may reuse. `per_key`: only its own API key's (each key's salt
    # roots the block hash chain, engine/hashing.py), so one tenant cannot learn from a
    # faster first token that another sent a prompt. `none`: everyone's, unless the
    # request sends a `cache_salt`.
    cache_isolation: Literal["none", "per_key"] = "none"
    # Origins a browser may call the API from; empty = CORS off (no CORS headers at all).
    cors_allow_origins: tuple[str, ...] = ()
