"""The prefill pool's Serve deployment.

An `Engine` in prefill role computes each prompt (prefix cache first), samples the
first token and leaves the request's blocks pinned. This replica then grants a
**lease** on them and returns `PrefillResult(first_token, kv_handle)`. The lease
ends exactly once: decode's `Release` (blocks stay as prefix cache), decode's
`Reject` (freed at once), or expiry (a sweeper frees it after `lease_ttl_s`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from cluster.config import ClusterConfig
from cluster.replica import node_ip, replica_id, start_engine, warm_up
from engine.sampling_params import SamplingParams
from kvtransfer.backends import make_backend
from kvtransfer.control import ControlMessage, ControlServer
from kvtransfer.lease import LeaseTable
from kvtransfer.messages import KVHandle, PrefillResult, Release

log = logging.getLogger(__name__)


class PrefillServer:
    """Owns one prefill engine, its KV transfer backend, its leases and control port."""

    def __init__(self, config: dict):
        cfg = ClusterConfig.model_validate(config)
        self.cfg = cfg
        self.replica_id = replica_id()
        self.aengine = start_engine(cfg, cfg.prefill, role="prefill")
        engine = self.aengine.engine
        self.aengine.submit(lambda: warm_up(engine)).result()
        self.backend = make_backend(cfg.transfer.backend, self.replica_id, engine.model_id)
        self.backend.register(engine.kv_cache.data)
        self.leases = LeaseTable(self._free_blocks, default_ttl_s=cfg.transfer.lease_ttl_s)
        self.control = ControlServer(self._on_control)
        self.control_address = (node_ip(), self.control.port)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_leases, name="lease-sweeper", daemon=True)
        self._sweeper.start()
        log.info("prefill replica %s ready (backend %s)", self.replica_id, self.backend.name)

    # ------------------------------------------------------------ leases
    def _free_blocks(self, block_ids) -> None:
        engine = self.aengine.engine
        ids = list(block_ids)
        self.aengine.submit(lambda: engine.release_blocks(ids))

    def _on_control(self, msg: ControlMessage) -> None:
        if isinstance(msg, Release):
            self.leases.release(msg.lease_id)
        else:
            self.leases.reject(msg.lease_id)

    def _sweep_leases(self) -> None:
        while not self._stop.wait(0.25):
            for lease in self.leases.expire():
                log.warning("lease %s of %s expired: blocks freed", lease.lease_id, lease.request_id)

    # ------------------------------------------------------------ requests
    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> PrefillResult:
        engine = self.aengine.engine
        stream = await self.aengine.add(
            request_id, lambda: engine.add_request(prompt_token_ids, sampling, request_id=request_id)
        )
        final = None
        async for outs in stream:
            final = outs[-1]
        assert final is not None and final.finished
        if final.finish_reason == "abort":
            raise asyncio.CancelledError(f"{request_id} aborted")
        first = final.new_token_ids[0]
        logprobs = final.logprobs[0] if final.logprobs else None
        handle = None
        reason = final.finish_reason
        if reason == "prefill_done":
            export = await self.aengine.call(lambda: engine.take_export(request_id))
            lease = self.leases.grant(request_id, export.block_ids)
            handle = KVHandle(
                request_id=request_id,
                prefill_replica_id=self.replica_id,
                backend=self.backend.name,
                peer=self.backend.peer_info(),
                block_ids=tuple(export.block_ids),
                num_tokens=export.num_tokens,
                fingerprint=self.backend.fingerprint,
                lease_id=lease.lease_id,
                lease_expiry=lease.expiry,
                control_address=self.control_address,
            )
            reason = None
        return PrefillResult(
            request_id=request_id,
            first_token=first,
            kv_handle=handle,
            num_cached_tokens=final.num_cached_tokens,
            num_prompt_tokens=final.num_prompt_tokens,
            first_token_logprobs=logprobs,
            text=final.text,
            finish_reason=reason,
        )

    async def stats(self) -> dict:
        counters = self.leases.counters()
        return {
            **self.aengine.stats,
            "replica_id": self.replica_id,
            "leases_active": len(self.leases),
            "leases_granted": counters.granted,
            "leases_released": counters.released,
            "leases_rejected": counters.rejected,
            "leases_expired": counters.expired,
        }

    async def take_kv_events(self) -> list:
        return self.aengine.take_kv_events()

    async def check_health(self) -> None:
        if self.aengine._error is not None:
            raise RuntimeError(f"engine dead: {self.aengine._error}")

    def __del__(self):
        self._stop.set()
        try:
            self.control.close()
            self.backend.close()
            self.aengine.shutdown()
        except Exception:
            pass
