"""The prefill pool's Serve deployment.

An `Engine` in prefill role computes each prompt (prefix cache first), samples the
first token and leaves the request's blocks pinned. This replica then grants a
**lease** on them and returns `PrefillResult(first_token, kv_handle)`. The lease
ends exactly once: decode's `Release` (blocks stay as prefix cache), decode's
`Reject` (freed at once), or expiry (a sweeper frees it after `lease_ttl_s`).

With `cache` tiers configured, the engine looks a prompt up in LMCache (CPU,
disk, Redis) after its own block pool and stores each new prompt's full chunks
there (prefill/kv_tier.py through engine/external_kv.py). The replica publishes
its block pool's KV events for the routers (prefill/kv_event_log.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from cluster.config import ClusterConfig
from cluster.replica import node_ip, replica_id, start_engine
from engine.sampling_params import SamplingParams
from kvtransfer.backends import make_backend
from kvtransfer.control import ControlMessage, ControlServer
from kvtransfer.lease import LeaseTable
from kvtransfer.messages import KVHandle, PrefillResult, Release
from prefill.kv_event_log import KVEventLog

log = logging.getLogger(__name__)


class PrefillServer:
    """Owns one prefill engine, its KV transfer backend, its leases and control port."""

    def __init__(self, config: dict):
        cfg = ClusterConfig.model_validate(config)
        self.cfg = cfg
        self.replica_id = replica_id()
        self.aengine = start_engine(cfg, cfg.prefill, role="prefill")
        engine = self.aengine.engine
        self.tier = None
        if cfg.cache.enabled:
            from prefill.kv_tier import KVTier

            self.tier = KVTier(cfg.cache.tier_config(), engine.kv_cache.data, engine.model_fingerprint)
            self.aengine.submit(lambda: engine.attach_external_kv(self.tier)).result()
        self.event_log = KVEventLog(cfg.engine.block_size, cfg.router.event_log_max_hashes)
        self.redis_index = None
        if cfg.router.prefix_index == "redis":
            from routing.prefix_index import RedisPrefixIndex

            self.redis_index = RedisPrefixIndex(cfg.router.redis_url, key_prefix=cfg.router.index_key_prefix)
        self._events_lock = threading.Lock()
        self.backend = make_backend(cfg.transfer.backend, self.replica_id, engine.model_id)
        self.backend.register(engine.kv_cache.data)
        self.leases = LeaseTable(self._free_blocks, default_ttl_s=cfg.transfer.lease_ttl_s)
        engine.on_export = lambda export: self.leases.grant(export.request_id, export.block_ids)
        self.control = ControlServer(self._on_control)
        self.control_address = (node_ip(), self.control.port)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_leases, name="lease-sweeper", daemon=True)
        self._sweeper.start()
        self._publisher = threading.Thread(target=self._publish_events, name="kv-events", daemon=True)
        self._publisher.start()
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

    # ------------------------------------------------------------ KV events
    def _publish_events(self) -> None:
        while not self._stop.wait(0.05):
            self._drain_events()

    def _drain_events(self) -> None:
        with self._events_lock:
            events = self.aengine.take_kv_events()
            if not events:
                return
            self.event_log.extend(events)
            if self.redis_index is not None:
                self.redis_index.apply(self.replica_id, events)  # buffers and replays on outage

    def record_routing_stats(self) -> dict:
        """Read by Serve every `router.stats_period_s` and handed to every router."""
        self._drain_events()
        s = self.aengine.stats
        out = {
            "queued_prefill_tokens": s["queued_prefill_tokens"],
            "num_running": s["num_running"] + s["num_waiting"],
            "kv_blocks_free": s["kv_blocks_free"],
            "kv_blocks_total": s["kv_blocks_total"],
            "model_fingerprint": self.aengine.engine.model_fingerprint,
            "reported_at": time.time(),
        }
        if self.redis_index is None:
            out["kv_log"] = self.event_log.window()
        return out

    # ------------------------------------------------------------ requests
    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> PrefillResult:
        """`session_id` is a routing hint only (routing/request_router.py)."""
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
            lease = self.leases.lease_for(request_id)  # granted on the engine thread at finish
            if lease is None:
                raise RuntimeError(f"{request_id}: prefill finished but holds no lease")
            handle = KVHandle(
                request_id=request_id,
                prefill_replica_id=self.replica_id,
                backend=self.backend.name,
                peer=self.backend.peer_info(),
                block_ids=lease.block_ids,
                num_tokens=final.num_prompt_tokens,
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
            "kv_events_cached_blocks": self.event_log.num_cached,
            "prefix_index_errors": self.redis_index.errors if self.redis_index is not None else 0,
            **(self.tier.as_dict() if self.tier is not None else {}),
        }

    async def kv_event_log(self):
        """This replica's event log window (non-destructive; routers keep cursors)."""
        self._drain_events()
        return self.event_log.window()

    async def check_health(self) -> None:
        self.aengine.check_health()

    def shutdown(self) -> None:
        """Stop threads, the engine, then close the tier (bounded: see kv_tier.close)."""
        if self._stop.is_set():
            return
        self._stop.set()
        for close in (self.control.close, self.backend.close, self.aengine.shutdown):
            try:
                close()
            except Exception:
                log.exception("prefill shutdown step failed")
        if self.tier is not None:
            self.tier.close()
        if self.redis_index is not None:
            self.redis_index.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
