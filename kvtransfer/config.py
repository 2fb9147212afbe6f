"""Settings of the KV handoff (the cluster config's `transfer:` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtransfer.lease import DEFAULT_LEASE_TTL_S


class TransferConfig(BaseModel):
    """How decode pulls a prefill replica's KV, and what happens when it cannot."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["nixl", "torch"] = "nixl"
    # How long exported blocks stay pinned without an answer from decode.
    lease_ttl_s: float = Field(DEFAULT_LEASE_TTL_S, gt=0)
    # Bound on one pull and on one control message.
    timeout_s: float = Field(10.0, gt=0)
    # recompute: decode prefills the prompt itself (a failed pull costs latency, not the
    # request); error: the request fails with a clear error. A layout or backend
    # mismatch is a configuration error and fails either way.
    on_failure: Literal["error", "recompute"] = "recompute"
    # A decode replica that Serve drains (scale-down, rolling update) hands its
    # decoding sequences, KV and all, to the pool's other replicas; off: it finishes
    # them itself (the stopped replica lives until they end, up to drain_timeout_s).
    move_on_drain: bool = True
    # NIXL: the UCX transports (UCX_TLS) its agents may use, e.g. "tcp,self" to force
    # the network path between nodes, "rc,ud,self" for RDMA. None: UCX chooses.
    ucx_tls: str | None = Field(None, pattern=r"^\^?[a-z0-9_,:]+$")
