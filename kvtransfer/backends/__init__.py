"""Transfer backends, chosen by name from config: ``make_backend("nixl" | "torch", ...)``."""

from __future__ import annotations

import importlib
from typing import Any

from kvtransfer.backends.base import (
    KVTransferBackend,
    MetricsSnapshot,
    PeerDisconnected,
    PeerInfo,
    TransferError,
    TransferMetrics,
    TransferStats,
    TransferTimeout,
)
from kvtransfer.config import TransferConfig

# Imported lazily: nixl loads UCX plugins, which a torch-only replica should not pay for.
_BACKENDS = {
    "nixl": ("kvtransfer.backends.nixl_backend", "NixlBackend"),
    "torch": ("kvtransfer.backends.torch_backend", "TorchBackend"),
}

BACKEND_NAMES = tuple(_BACKENDS)
DEFAULT_BACKEND = "nixl"


def backend_class(name: str) -> type[KVTransferBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; expected one of {list(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, replica_id: str, model_id: str, **kw) -> KVTransferBackend:
    """Create a backend for one replica; ``kw`` are the backend's own options."""
    return backend_class(name)(replica_id, model_id, **kw)


def backend_for(cfg: TransferConfig, replica_id: str, model_id: str, host: str) -> KVTransferBackend:
    """The backend `transfer:` names, for a replica whose peers reach it at `host`
    (its node's cluster address: gloo binds to it; UCX finds its own interfaces)."""
    by_backend: dict[str, dict[str, Any]] = {"torch": {"host": host}, "nixl": {"ucx_tls": cfg.ucx_tls}}
    options = by_backend[cfg.backend]
    return make_backend(cfg.backend, replica_id, model_id, **options)


__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "KVTransferBackend",
    "MetricsSnapshot",
    "PeerDisconnected",
    "PeerInfo",
    "TransferError",
    "TransferMetrics",
    "TransferStats",
    "TransferTimeout",
    "backend_class",
    "backend_for",
    "make_backend",
]
