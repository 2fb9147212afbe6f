"""The decode pool's Serve deployment.

For each `DecodeRequest`: check the layout fingerprint, reserve blocks, pull the KV
from the prefill replica (NIXL READ, or the torch backend), tell the owner to
`Release` (or `Reject` when anything fails), then join the running batch and stream
tokens. A failed import fails the request with a clear error, or recomputes the
prompt here when `transfer.on_failure: recompute`; either way it is counted.
"""

from __future__ import annotations

import asyncio
import time
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.replica import replica_id, start_engine
from engine.request import RequestOutput
from kvtransfer import control
from kvtransfer.backends import make_backend
from kvtransfer.backends.base import TransferError
from kvtransfer.layout import LayoutMismatch
from kvtransfer.messages import DecodeRequest, ImportFailed, Reject, RejectReason, Release

log = logging.getLogger(__name__)


@dataclass
class ImportCounters:
    imported: int = 0
    rejected: int = 0
    failed: int = 0
    recomputed: int = 0


class DecodeServer:
    """Owns one decode engine and its KV transfer backend."""

    def __init__(self, config: dict):
        cfg = ClusterConfig.model_validate(config)
        self.cfg = cfg
        self.replica_id = replica_id()
        self.aengine = start_engine(cfg, cfg.decode, role="decode")
        engine = self.aengine.engine
        self.backend = make_backend(cfg.transfer.backend, self.replica_id, engine.model_id)
        self.backend.register(engine.kv_cache.data)
        self.counters = ImportCounters()
        log.info("decode replica %s ready (backend %s)", self.replica_id, self.backend.name)

    def _notify(self, req: DecodeRequest, msg) -> None:
        addr = req.kv_handle.control_address
        if addr is not None:
            control.send(tuple(addr), msg, timeout_s=self.cfg.transfer.timeout_s)

    async def _import(self, req: DecodeRequest) -> list[int] | None:
        """Blocks holding the prompt's KV, or None to recompute. Raises ImportFailed."""
        h = req.kv_handle
        engine = self.aengine.engine
        reason, detail = None, ""
        blocks = None
        try:
            self.backend.fingerprint.check_compatible(h.fingerprint)
            if h.expired():
                reason, detail = RejectReason.LEASE_EXPIRED, f"lease {h.lease_id} expired before the pull"
            else:
                blocks = await self.aengine.call(lambda: engine.reserve_import(h.num_tokens))
                if blocks is None:
                    reason, detail = RejectReason.NO_FREE_BLOCKS, "decode replica has no free KV blocks"
        except LayoutMismatch as e:
            reason, detail = RejectReason.LAYOUT_MISMATCH, str(e)
        if reason is None:
            try:
                timeout = min(self.cfg.transfer.timeout_s, max(h.seconds_left(), 0.1))
                await asyncio.to_thread(self.backend.pull, h.peer, h.block_ids, blocks, timeout)
                self.counters.imported += 1
                await asyncio.to_thread(self._notify, req, Release(req.request_id, h.lease_id))
                return blocks
            except TransferError as e:
                reason, detail = RejectReason.TRANSFER_FAILED, str(e)
                ids = blocks
                await self.aengine.call(lambda: engine.release_blocks(ids))
        # Every failure path frees the prefill side at once.
        if reason == RejectReason.NO_FREE_BLOCKS:
            self.counters.rejected += 1
        else:
            self.counters.failed += 1
        await asyncio.to_thread(self._notify, req, Reject(req.request_id, h.lease_id, str(reason)))
        if self.cfg.transfer.on_failure == "recompute" and reason != RejectReason.LAYOUT_MISMATCH:
            self.counters.recomputed += 1
            log.warning("recomputing %s after failed import: %s", req.request_id, detail)
            return None
        raise ImportFailed(str(reason), detail)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[list[RequestOutput]]:
        engine = self.aengine.engine
        blocks = await self._import(req)

        def start():
            try:
                engine.add_imported_request(
                    req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, blocks,
                    0,
                )
            except Exception:
                if blocks is not None:
                    engine.release_blocks(blocks)
                raise

        stream = await self.aengine.add(req.request_id, start)
        async for outs in stream:
            yield outs

    def record_routing_stats(self) -> dict:
        """Read by Serve every `router.stats_period_s` for the decode router."""
        s = self.aengine.stats
        return {
            "num_running": s["num_running"] + s["num_waiting"],
            "kv_blocks_free": s["kv_blocks_free"],
            "kv_blocks_total": s["kv_blocks_total"],
            "reported_at": time.time(),
        }

    async def stats(self) -> dict:
        m = self.backend.metrics.snapshot()  # the backend counts every pull, failures too
        return {
            **self.aengine.stats,
            "replica_id": self.replica_id,
            "transfer_count": m.transfers,
            "transfer_failures": m.failures,
            "transfer_bytes": m.bytes,
            "transfer_seconds": m.seconds,
            "transfer_blocks": m.blocks,
            "imports": self.counters.imported,
            "import_rejects": self.counters.rejected,
            "import_failures": self.counters.failed,
            "import_recomputes": self.counters.recomputed,
        }

    async def check_health(self) -> None:
        self.aengine.check_health()
