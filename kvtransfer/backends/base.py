"""The transfer-backend strategy: what every way of moving KV blocks provides.

A backend is created once per replica, ``register``s the replica's KV tensor once,
and then moves whole blocks (contiguous byte ranges, see ``kvtransfer.layout``).
Decode calls ``pull``; the prefill side only registers and publishes ``peer_info``.
Capability flags say what a backend needs from the deployments, so callers branch
on flags, never on backend names.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer.layout import LayoutFingerprint

if TYPE_CHECKING:  # the backends hold tensors; the messages naming a peer need no torch
    import torch


class TransferError(RuntimeError):
    """A KV transfer failed; the decode side should Reject the handle (or recompute)."""


class TransferTimeout(TransferError):
    """A cross-replica wait ran past its timeout."""


class PeerDisconnected(TransferError):
    """The remote replica is gone (or its connection broke); it was forgotten."""


@dataclass(frozen=True)
class PeerInfo:
    """What a decode replica needs to reach a prefill replica's registered KV.

    Subclassed per backend; carried inside every ``KVHandle`` (so it must pickle).
    ``peer_id`` is unique per backend instance, so a restarted replica is a new peer.
    """

    peer_id: str
    fingerprint: LayoutFingerprint
    num_blocks: int


@dataclass(frozen=True)
class TransferStats:
    """One completed transfer."""

    backend: str
    num_blocks: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class MetricsSnapshot:
    transfers: int
    failures: int
    bytes: int
    seconds: float
    blocks: int


class TransferMetrics:
    """Owns the running totals a deployment exports as ``duet_kv_transfer_*`` metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers = self._failures = self._bytes = self._blocks = 0
        self._seconds = 0.0

    def record(self, stats: TransferStats) -> None:
        with self._lock:
            self._transfers += 1
            self._bytes += stats.bytes
            self._blocks += stats.num_blocks
            self._seconds += stats.seconds

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(self._transfers, self._failures, self._bytes, self._seconds, self._blocks)


class KVTransferBackend(ABC):
    """Strategy for moving KV blocks between replicas; owns its connections and registrations.

    Capability flag (class attribute), checked by ``register``:
      ``supports_cuda``: a KV tensor on a CUDA device can be registered.
    """

    name: str = ""
    supports_cuda: bool = False

    def __init__(self, replica_id: str, model_id: str) -> None:
        self.replica_id = replica_id
        self.model_id = model_id
        self.metrics = TransferMetrics()
        self._kv: torch.Tensor | None = None
        self._fingerprint: LayoutFingerprint | None = None

    @property
    def fingerprint(self) -> LayoutFingerprint:
        if self._fingerprint is None:
            raise RuntimeError(f"{self.name} backend: register(kv) must be called first")
        return self._fingerprint

    @property
    def kv(self) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError(f"{self.name} backend: register(kv) must be called first")
        return self._kv

    def register(self, kv: torch.Tensor) -> None:
        """Make this replica's KV tensor transferable. Once per replica, before any transfer."""
        if self._kv is not None:
            raise RuntimeError(f"{self.name} backend: KV tensor already registered")
        if kv.is_cuda and not self.supports_cuda:
            raise ValueError(f"{self.name} backend does not support CUDA KV tensors")
        self._fingerprint = LayoutFingerprint.from_tensor(kv, self.model_id)
        self._kv = kv
        self._register(kv)

    @abstractmethod
    def _register(self, kv: torch.Tensor) -> None: ...

    @abstractmethod
    def peer_info(self) -> PeerInfo:
        """What goes into a KVHandle so that a decode replica can connect to this one."""

    def pull(
        self,
        peer: PeerInfo,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float,
    ) -> TransferStats:
        """Copy remote blocks into local blocks (same order); raise a ``TransferError`` on failure.

        Checks the layout fingerprint first: a mismatch raises ``LayoutMismatch``.
        """
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks vs {len(local_block_ids)} local blocks")
        if timeout_s <= 0:
            raise TransferTimeout(f"no time left to pull from {peer.peer_id}")
        self.fingerprint.check_compatible(peer.fingerprint)
        _check_ids(remote_block_ids, peer.num_blocks, "remote")
        _check_ids(local_block_ids, self.kv.shape[0], "local")
        try:
            stats = self._pull(peer, list(remote_block_ids), list(local_block_ids), timeout_s)
        except Exception:
            self.metrics.record_failure()
            raise
        self.metrics.record(stats)
        return stats

    @abstractmethod
    def _pull(
        self, peer: PeerInfo, remote_block_ids: list[int], local_block_ids: list[int], timeout_s: float
    ) -> TransferStats: ...

    def expect_reads(self, for_s: float) -> None:  # noqa: B027 - optional hook
        """Peers may read this replica's registered KV for the next `for_s` seconds (a
        lease is out, or a test peer serves). A backend whose target side must progress
        one-sided reads (NIXL over TCP) does so promptly until then, or until
        `reads_ended`, and lazily otherwise."""

    def reads_ended(self) -> None:  # noqa: B027 - optional hook
        """No lease is out any more: nobody may read until the next `expect_reads`."""

    def forget_peer(self, peer_id: str) -> None:  # noqa: B027 - optional hook
        """Drop cached connection state for a peer (e.g. the router saw the replica die)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections, threads and registrations. Idempotent."""

    def __enter__(self) -> KVTransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> None:
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"{side} block id {b} out of range [0, {num_blocks})")
