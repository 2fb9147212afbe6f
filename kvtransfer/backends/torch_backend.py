"""torch.distributed backend: prefill sends packed blocks, decode receives and scatters.

No global ``init_process_group``: each (prefill, decode) pair gets its own 2-rank
process group (gloo for CPU tensors, NCCL for CUDA) over a ``PrefixStore`` on a
``TCPStore`` that the prefill replica hosts (its host/port travel in the KVHandle).
The same store carries a request queue: decode pushes "connect" and "send these
blocks" requests, and a responder thread on the prefill side serves them, so the
deployments only ever call ``pull`` (decode) and ``register`` (both).

Wire protocol per pull: decode posts ``recv`` (tag t) into one packed buffer, then
pushes ``_Send(pair, t, block_ids)``; the responder ``index_select``s the blocks
into one contiguous buffer and sends it (tag t); decode scatters it into its blocks.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from kvtransfer.backends.base import (
    KVTransferBackend,
    PeerDisconnected,
    PeerInfo,
    TransferError,
    TransferStats,
    TransferTimeout,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_REQUESTS = "kv/requests"
# The responder blocks on the request queue this long before re-checking; close()
# wakes it at once with a _Stop, so this only bounds idle log noise from torch.
_IDLE_POP_S = 300.0


@dataclass(frozen=True)
class TorchPeerInfo(PeerInfo):
    """Where a prefill replica's TCPStore listens, and the device type of its KV."""

    host: str
    port: int
    device_type: str


@dataclass(frozen=True)
class _Connect:
    pair_id: str
    timeout_s: float


@dataclass(frozen=True)
class _Send:
    pair_id: str
    tag: int
    block_ids: tuple[int, ...]
    timeout_s: float


@dataclass(frozen=True)
class _Close:
    pair_id: str


@dataclass(frozen=True)
class _Stop:
    pass


class _Staging:
    """A packed-blocks buffer reused across transfers (grown, never shrunk).

    A fresh multi-MB buffer per transfer costs page faults on every copy; reuse is
    safe because each owner (a decode pair, the responder) runs one transfer at a time.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        self._kv = kv
        self._buf = kv.new_empty((0, *kv.shape[1:]))

    def take(self, num_blocks: int) -> torch.Tensor:
        if self._buf.shape[0] < num_blocks:
            self._buf = self._kv.new_empty((num_blocks, *self._kv.shape[1:]))
        return self._buf[:num_blocks]


@dataclass
class _Pair:
    """Decode-side state for one prefill peer: a store client, a 2-rank group, a staging buffer."""

    store: dist.TCPStore
    group: dist.ProcessGroup
    pair_id: str
    lock: threading.Lock
    staging: _Staging
    next_tag: int = 0


class TorchBackend(KVTransferBackend):
    """Owns this replica's TCPStore (prefill side), responder thread and pairwise groups.

    Two-sided: each pull is served by a send from the prefill replica's responder
    thread (started by ``register``), so that replica must stay up until its leases end.
    """

    name = "torch"
    supports_cuda = True

    def __init__(
        self,
        replica_id: str,
        model_id: str,
        *,
        host: str | None = None,
        port: int = 0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(replica_id, model_id)
        self.host = host or _default_host()
        self._port = port
        self._connect_timeout_s = connect_timeout_s
        self._peer_id = f"{replica_id}-{uuid.uuid4().hex[:8]}"
        self._server: dist.TCPStore | None = None
        self._responder: threading.Thread | None = None
        self._serving: dict[str, dist.ProcessGroup] = {}
        self._send_staging: _Staging | None = None
        self._pairs: dict[str, _Pair] = {}
        self._pairs_lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}
        self._closed = False

    def _register(self, kv: torch.Tensor) -> None:
        timeout = datetime.timedelta(seconds=self._connect_timeout_s)
        self._server = dist.TCPStore(self.host, self._port, is_master=True, wait_for_workers=False, timeout=timeout)
        self._responder = threading.Thread(target=self._serve_loop, name=f"kv-torch-{self.replica_id}", daemon=True)
        self._responder.start()

    def peer_info(self) -> TorchPeerInfo:
        if self._server is None:
            raise RuntimeError("torch backend: register(kv) must be called first")
        return TorchPeerInfo(
            peer_id=self._peer_id,
            fingerprint=self.fingerprint,
            num_blocks=self.kv.shape[0],
            host=self.host,
            port=self._server.port,
            device_type=self.kv.device.type,
        )

    def _pull(
        self, peer: PeerInfo, remote_block_ids: list[int], local_block_ids: list[int], timeout_s: float
    ) -> TransferStats:
        if not isinstance(peer, TorchPeerInfo):
            raise TypeError(f"torch backend cannot pull from {type(peer).__name__}")
        if peer.device_type != self.kv.device.type:
            raise TransferError(f"peer KV is on {peer.device_type}, local KV on {self.kv.device.type}")
        deadline = time.monotonic() + timeout_s
        start = time.perf_counter()
        n = len(remote_block_ids)
        if n:
            pair = self._connect(peer, deadline)
            with pair.lock:
                self._recv_into(pair, peer.peer_id, remote_block_ids, local_block_ids, deadline)
        seconds = time.perf_counter() - start
        return TransferStats(self.name, n, n * self.fingerprint.bytes_per_block, seconds)

    def _recv_into(
        self, pair: _Pair, peer_id: str, remote_ids: list[int], local_ids: list[int], deadline: float
    ) -> None:
        kv = self.kv
        buf = pair.staging.take(len(remote_ids))
        tag = pair.next_tag
        pair.next_tag += 1
        remaining = _remaining(deadline, peer_id)
        try:
            work = pair.group.recv([buf], 0, tag)
            pair.store.queue_push(_REQUESTS, pickle.dumps(_Send(pair.pair_id, tag, tuple(remote_ids), remaining)))
            work.wait(datetime.timedelta(seconds=_remaining(deadline, peer_id)))
        except Exception as exc:
            # A group that failed mid-transfer is unusable (tags and buffers are out
            # of step), so forget it; the next pull reconnects if the peer is alive.
            self.forget_peer(peer_id)
            raise _classify(exc, peer_id, deadline) from exc
        kv.index_copy_(0, torch.as_tensor(local_ids, device=kv.device), buf)

    def _connect(self, peer: TorchPeerInfo, deadline: float) -> _Pair:
        # One lock per peer: connecting to a dead peer takes up to the timeout and
        # must not hold up pulls from the others.
        with self._pairs_lock:
            pair = self._pairs.get(peer.peer_id)
            if pair is not None:
                return pair
            connecting = self._connecting.setdefault(peer.peer_id, threading.Lock())
        with connecting:
            with self._pairs_lock:
                pair = self._pairs.get(peer.peer_id)
            if pair is not None:
                return pair
            remaining = _remaining(deadline, peer.peer_id)
            pair_id = f"{self._peer_id}/{uuid.uuid4().hex[:8]}"

            def connect() -> _Pair:
                store = dist.TCPStore(
                    peer.host, peer.port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=remaining),
                )
                store.queue_push(_REQUESTS, pickle.dumps(_Connect(pair_id, remaining)))
                group = _make_group(store, pair_id, 1, remaining, self.kv.device, self.host)
                return _Pair(store, group, pair_id, threading.Lock(), _Staging(self.kv))

            try:
                pair = _call_with_deadline(connect, deadline, on_late=lambda p: _shutdown(p.group))
            except Exception as exc:
                raise _classify(exc, peer.peer_id, deadline) from exc
            with self._pairs_lock:
                self._pairs[peer.peer_id] = pair
            return pair

    def forget_peer(self, peer_id: str) -> None:
        with self._pairs_lock:
            pair = self._pairs.pop(peer_id, None)
        if pair is None:
            return
        try:
            pair.store.queue_push(_REQUESTS, pickle.dumps(_Close(pair.pair_id)))
        except Exception as exc:  # the peer is probably gone; nothing to tell it
            log.debug("telling %s to close pair %s: %s", peer_id, pair.pair_id, exc)
        _shutdown(pair.group)

    def serve_send(self, pair_id: str, block_ids: tuple[int, ...], tag: int, timeout_s: float) -> None:
        """Prefill side: pack ``block_ids`` into one buffer and send it to the pair's decode rank."""
        group = self._serving.get(pair_id)
        if group is None:
            raise PeerDisconnected(f"no connected decode for pair {pair_id}")
        # Only the responder thread sends, one transfer at a time: one staging buffer.
        if self._send_staging is None:
            self._send_staging = _Staging(self.kv)
        packed = self._send_staging.take(len(block_ids))
        torch.index_select(self.kv, 0, torch.as_tensor(block_ids, device=self.kv.device), out=packed)
        try:
            group.send([packed], 1, tag).wait(datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            _shutdown(self._serving.pop(pair_id, group))
            raise PeerDisconnected(f"send on pair {pair_id} failed: {exc}") from exc

    def _serve_loop(self) -> None:
        # A client of our own store: the server object does not block on queue_pop.
        client = dist.TCPStore(
            self.host, self._server.port, is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=_IDLE_POP_S),
        )
        while True:
            try:
                msg = pickle.loads(client.queue_pop(_REQUESTS))
            except dist.DistStoreError:
                if self._closed:
                    return
                continue  # idle timeout
            except Exception as exc:
                if not self._closed:
                    log.error("torch KV responder lost its store: %s", exc)
                return
            if isinstance(msg, _Stop):
                return
            try:
                self._handle(msg)
            except Exception as exc:
                # One decode's failure must not stop the responder for the others.
                log.warning("torch KV responder: %s failed: %s", type(msg).__name__, exc)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, _Connect):
            # Its own client, so the rendezvous waits at most the decode's timeout.
            pair_store = dist.TCPStore(
                self.host, self._server.port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=msg.timeout_s),
            )
            self._serving[msg.pair_id] = _make_group(
                pair_store, msg.pair_id, 0, msg.timeout_s, self.kv.device, self.host
            )
        elif isinstance(msg, _Send):
            self.serve_send(msg.pair_id, msg.block_ids, msg.tag, msg.timeout_s)
        elif isinstance(msg, _Close):
            group = self._serving.pop(msg.pair_id, None)
            if group is not None:
                _shutdown(group)
        else:
            log.warning("torch KV responder: unknown message %r", msg)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer_id in list(self._pairs):
            self.forget_peer(peer_id)
        if self._server is not None and self._responder is not None:
            try:
                self._server.queue_push(_REQUESTS, pickle.dumps(_Stop()))
            except Exception as exc:
                log.debug("stopping torch KV responder: %s", exc)
            self._responder.join(timeout=5.0)
        for group in self._serving.values():
            _shutdown(group)
        self._serving.clear()
        self._server = None  # stops listening once the responder's client is gone


def _make_group(
    store: dist.Store, pair_id: str, rank: int, timeout_s: float, device: torch.device, host: str
) -> dist.ProcessGroup:
    """A 2-rank group (prefill rank 0, decode rank 1); blocks until both ranks join."""
    prefixed = dist.PrefixStore(f"kv/pair/{pair_id}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Bind to the advertised address, not whatever the hostname resolves to.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def _call_with_deadline(fn: Callable[[], T], deadline: float, on_late: Callable[[T], None]) -> T:
    """Run ``fn`` in a helper thread and stop waiting for it at ``deadline``.

    ``TCPStore``'s client constructor ignores its timeout when the server process
    accepts the TCP connection but never answers (e.g. it is stopped), so connecting
    cannot be trusted to return on time. A late result is handed to ``on_late``.
    """
    lock = threading.Lock()
    done = threading.Event()
    box: dict[str, object] = {}
    abandoned = False

    def run() -> None:
        try:
            outcome = ("result", fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            outcome = ("error", exc)
        with lock:
            if not abandoned:
                box[outcome[0]] = outcome[1]
                done.set()
                return
        if outcome[0] == "result":
            on_late(outcome[1])

    threading.Thread(target=run, name="kv-torch-connect", daemon=True).start()
    done.wait(max(0.0, deadline - time.monotonic()))
    with lock:
        if not done.is_set():
            abandoned = True
            raise TransferTimeout("connecting timed out")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _shutdown(group: dist.ProcessGroup) -> None:
    try:
        group.abort()
    except Exception as exc:
        log.debug("aborting process group: %s", exc)


def _remaining(deadline: float, peer_id: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"torch transfer from {peer_id} timed out")
    return left


def _classify(exc: Exception, peer_id: str, deadline: float) -> TransferError:
    if isinstance(exc, TransferError):
        return exc
    text = str(exc).lower()
    if time.monotonic() >= deadline or "timed out" in text or "timeout" in text:
        return TransferTimeout(f"torch transfer from {peer_id} timed out: {exc}")
    return PeerDisconnected(f"torch transfer from {peer_id} failed: {exc}")


def _default_host() -> str:
    """This host's address as other hosts see it (loopback when the name does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
