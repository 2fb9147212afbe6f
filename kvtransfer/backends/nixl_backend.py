"""NIXL backend (the default): decode READs prefill's registered KV blocks over UCX.

One NIXL agent per replica, the KV tensor registered once. The prefill side does
nothing per transfer: its agent metadata travels inside every KVHandle (the side
channel), decode loads it once per peer, prepares one descriptor per remote block
(blocks are contiguous byte ranges), warms the connection up with a tiny READ, and
then pulls any block list with one prepared READ.

Progress: NIXL's built-in progress thread busy-spins a core per agent (measured),
so it is off. Decode drives its own progress by polling ``check_xfer_state`` with a
backoff sleep. The target side still has to progress now and then: measured here,
without it the first READ to a new peer never completes (UCX wire-up needs the
target's answer), and UCX over TCP emulates READ with target-side messages. So every
agent runs a pump thread that progresses the worker every ``progress_interval_s``
(default 2 ms) while reads are expected, i.e. while a lease the replica granted may be
pulled (``expect_reads`` until ``reads_ended``), and every ``idle_progress_interval_s``
(100 ms) otherwise.
Pumping every 2 ms all the time cost an idle replica ~4% of a core and its event loop
500 GIL hand-offs a second (measured). None turns the pump off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.backends.base import (
    KVTransferBackend,
    PeerDisconnected,
    PeerInfo,
    TransferError,
    TransferStats,
    TransferTimeout,
)

log = logging.getLogger(__name__)

_WARMUP_BYTES = 64
# Backoff between polls: short first (CMA reads of a few MB finish in ~1 ms),
# capped so a slow transfer costs at most this much extra latency.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


@dataclass(frozen=True)
class NixlPeerInfo(PeerInfo):
    """A prefill agent's name and metadata, plus where its blocks live."""

    agent_metadata: bytes
    base_addr: int
    bytes_per_block: int
    mem_type: str
    device_id: int


@dataclass
class _Peer:
    """Decode-side state for one remote agent: its prepared block descriptors."""

    agent_name: str
    remote_dlist: Any  # a nixl prepared descriptor list (nixl ships no type stubs)


class NixlBackend(KVTransferBackend):
    """Owns this replica's NIXL agent, its KV registration and its remote peers."""

    name = "nixl"
    supports_cuda = True

    def __init__(
        self,
        replica_id: str,
        model_id: str,
        *,
        progress_interval_s: float | None = 0.002,
        idle_progress_interval_s: float = 0.1,
        num_threads: int = 0,
        ucx_tls: str | None = None,
    ) -> None:
        super().__init__(replica_id, model_id)
        if ucx_tls:
            # UCX reads its transports when the agent creates its context, below.
            os.environ["UCX_TLS"] = ucx_tls
        from nixl._api import nixl_agent, nixl_agent_config

        # A fresh suffix per process: a restarted replica must not be mistaken for
        # the old one whose metadata a decode still has cached.
        self.agent_name = f"{replica_id}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"], num_threads=num_threads
        )
        self._agent = nixl_agent(self.agent_name, config)
        # The agent runs without NIXL's internal locking (sync mode NONE), so every
        # call goes through this lock: pulls, the pump thread and close may race.
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._reg = None
        self._local_dlist = None
        self._scratch: torch.Tensor | None = None
        self._scratch_reg = None
        self._progress_interval_s = progress_interval_s
        self._idle_progress_interval_s = max(idle_progress_interval_s, progress_interval_s or 0.0)
        self._reads_until = 0.0  # time.monotonic()
        self._wake = threading.Event()  # set by expect_reads (a lease is out) and close
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        self._closed = False

    def _register(self, kv: torch.Tensor) -> None:
        mem_type = "VRAM" if kv.is_cuda else "DRAM"
        with self._lock:
            self._reg = self._agent.register_memory(kv, backends=["UCX"])
            self._local_dlist = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _block_descs(kv.data_ptr(), self.fingerprint.bytes_per_block,
                                                kv.shape[0], _device_id(kv)), mem_type
            )
            # Warm-up reads land here, never in a KV block that may be in use.
            self._scratch = torch.empty(_WARMUP_BYTES, dtype=torch.uint8, device=kv.device)
            self._scratch_reg = self._agent.register_memory(self._scratch, backends=["UCX"])
        if self._progress_interval_s:
            self._pump = threading.Thread(target=self._pump_loop, name=f"nixl-pump-{self.replica_id}", daemon=True)
            self._pump.start()

    def peer_info(self) -> NixlPeerInfo:
        kv = self.kv
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return NixlPeerInfo(
            peer_id=self.agent_name,
            fingerprint=self.fingerprint,
            num_blocks=kv.shape[0],
            agent_metadata=metadata,
            base_addr=kv.data_ptr(),
            bytes_per_block=self.fingerprint.bytes_per_block,
            mem_type="VRAM" if kv.is_cuda else "DRAM",
            device_id=_device_id(kv),
        )

    def _pull(
        self, peer: PeerInfo, remote_block_ids: list[int], local_block_ids: list[int], timeout_s: float
    ) -> TransferStats:
        if not isinstance(peer, NixlPeerInfo):
            raise TypeError(f"nixl backend cannot pull from {type(peer).__name__}")
        deadline = time.monotonic() + timeout_s
        start = time.perf_counter()
        state = self._connect(peer, deadline)
        if remote_block_ids:
            with self._lock:
                handle = self._agent.make_prepped_xfer(
                    "READ", self._local_dlist, np.asarray(local_block_ids, dtype=np.int32),
                    state.remote_dlist, np.asarray(remote_block_ids, dtype=np.int32),
                )
            self._run(handle, peer.peer_id, deadline)
        seconds = time.perf_counter() - start
        num_blocks = len(remote_block_ids)
        return TransferStats(self.name, num_blocks, num_blocks * peer.bytes_per_block, seconds)

    def _connect(self, peer: NixlPeerInfo, deadline: float) -> _Peer:
        with self._lock:
            state = self._peers.get(peer.peer_id)
            if state is not None:
                return state
            try:
                name = self._agent.add_remote_agent(peer.agent_metadata)
                if isinstance(name, bytes):
                    name = name.decode()
                if name != peer.peer_id:  # metadata of another agent than the handle names
                    self._drop_locked(name)
                    raise PeerDisconnected(f"NIXL metadata is agent {name!r}, the handle names {peer.peer_id!r}")
                remote_dlist = self._agent.prep_xfer_dlist(
                    name, _block_descs(peer.base_addr, peer.bytes_per_block, peer.num_blocks, peer.device_id),
                    peer.mem_type,
                )
                warmup = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(self._scratch),
                    self._agent.get_xfer_descs(
                        [(peer.base_addr, _WARMUP_BYTES, peer.device_id)], peer.mem_type
                    ),
                    name,
                )
            except Exception as exc:  # nixl raises its own binding errors
                self._drop_locked(peer.peer_id)
                raise PeerDisconnected(f"cannot connect to NIXL agent {peer.peer_id}: {exc}") from exc
            state = _Peer(name, remote_dlist)
            self._peers[peer.peer_id] = state
        # The first transfer to a peer pays 40-120 ms of connection setup; do it
        # here, on a scratch buffer, so a failure is a connect failure, not a bad pull.
        self._run(warmup, peer.peer_id, deadline)
        return state

    def _run(self, handle, peer_id: str, deadline: float) -> None:
        """Post a prepared transfer and poll it to completion, failure or deadline."""
        try:
            with self._lock:
                status = self._agent.transfer(handle)
            sleep_s = _POLL_MIN_S
            while status == "PROC":
                if time.monotonic() >= deadline:
                    # Disconnecting cancels the in-flight READ, so it cannot land in
                    # local blocks after the caller has given them back to the pool.
                    self.forget_peer(peer_id)
                    raise TransferTimeout(f"NIXL READ from {peer_id} timed out")
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, _POLL_MAX_S)
                with self._lock:
                    status = self._agent.check_xfer_state(handle)
            if status != "DONE":
                self.forget_peer(peer_id)
                raise PeerDisconnected(f"NIXL READ from {peer_id} failed ({status}); peer forgotten")
        except TransferError:
            raise
        except Exception as exc:
            self.forget_peer(peer_id)
            raise PeerDisconnected(f"NIXL READ from {peer_id} failed: {exc}") from exc
        finally:
            with self._lock:
                try:
                    handle.release()
                except Exception as exc:  # an un-cancellable transfer: the agent retries at teardown
                    log.warning("could not release NIXL transfer handle: %s", exc)

    def forget_peer(self, peer_id: str) -> None:
        with self._lock:
            self._drop_locked(peer_id)

    def _drop_locked(self, peer_id: str) -> None:
        state = self._peers.pop(peer_id, None)
        if state is not None:
            try:
                state.remote_dlist.release()
            except Exception as exc:
                log.debug("releasing remote dlist of %s: %s", peer_id, exc)
        try:
            self._agent.remove_remote_agent(peer_id)
        except Exception as exc:  # never loaded, or already gone
            log.debug("removing NIXL agent %s: %s", peer_id, exc)

    def expect_reads(self, for_s: float) -> None:
        until = time.monotonic() + for_s
        if until > self._reads_until:
            self._reads_until = until
            self._wake.set()  # a pump asleep for its idle interval starts pumping now

    def reads_ended(self) -> None:
        self._reads_until = 0.0

    @property
    def pump_interval_s(self) -> float | None:
        """How long the pump sleeps now between progress calls (None: no pump)."""
        if self._progress_interval_s is None:
            return None
        reads = time.monotonic() < self._reads_until
        return self._progress_interval_s if reads else self._idle_progress_interval_s

    def _pump_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.pump_interval_s)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                self._agent.get_new_notifs()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._pump is not None:
            self._pump.join(timeout=1.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer_id in list(self._peers):
                self._drop_locked(peer_id)
            if self._local_dlist is not None:
                self._local_dlist.release()
            for reg in (self._reg, self._scratch_reg):
                if reg is not None:
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception as exc:
                        log.debug("deregistering NIXL memory: %s", exc)


def _device_id(kv: torch.Tensor) -> int:
    return kv.get_device() if kv.is_cuda else 0


def _block_descs(base_addr: int, bytes_per_block: int, num_blocks: int, device_id: int) -> np.ndarray:
    """One (addr, len, device) row per block: blocks are contiguous, so one descriptor each."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(bytes_per_block)
    descs[:, 1] = bytes_per_block
    descs[:, 2] = device_id
    return descs
