"""The lease control channel: decode (or the gateway) tells the prefill replica that
owns a lease to `Release` or `Reject` it.

Each prefill replica listens on one TCP port of its node's cluster address; the
address travels in the `KVHandle`. A message is one JSON line (never pickle from
the network) on its own connection, and the reply is ``ok``. Nothing waits forever:
every read has a timeout, and a lost message only means the lease ends by TTL.

Authentication: the replica holds a random secret; each lease's key is
``HMAC(secret, lease_id)`` and travels to decode inside the lease's `KVHandle`
(over Ray, never on this channel). A message carries a timestamp, a nonce and
``HMAC(lease_key, message)``. The server drops, and counts, any message that is
malformed, oversized, unauthenticated, outside the timestamp window, or a replay of
a nonce it has seen: such a message never frees a block, even with a live lease id.
A key only authorizes its own lease, and nobody needs a secret distributed to them.

Bounded: the server is one asyncio loop on one thread, so an idle connection costs
a file descriptor, not a thread; past `max_connections` the oldest connection is
closed to admit the new one, so a flood of idle connections cannot lock out a
real sender (who writes its line the moment it connects).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from kvtransfer.messages import Reject, Release

log = logging.getLogger(__name__)

ControlMessage = Release | Reject

MAX_LINE_BYTES = 4096
# A message older or newer than this is refused; nonces are remembered as long.
TIMESTAMP_WINDOW_S = 30.0
READ_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 128


class InvalidMessage(ValueError):
    """A control message the server refuses; `reason` is the counter it lands in."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _payload(msg: ControlMessage, ts: float, nonce: str) -> dict:
    body = {"type": type(msg).__name__, "request_id": msg.request_id, "lease_id": msg.lease_id, "ts": ts,
            "nonce": nonce}
    if isinstance(msg, Reject):
        body["reason"] = msg.reason
    return body


def _mac(key: bytes, payload: dict) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def encode(msg: ControlMessage, key: bytes, now: float | None = None) -> bytes:
    """One signed JSON line."""
    payload = _payload(msg, time.time() if now is None else now, secrets.token_hex(16))
    return (json.dumps({**payload, "mac": _mac(key, payload)}) + "\n").encode()


def _parse(line: bytes) -> tuple[ControlMessage, dict, str]:
    """(message, the signed payload, its mac); raises InvalidMessage("malformed")."""
    try:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        kind, mac = data.pop("type"), data.pop("mac")
        request_id, lease_id, ts, nonce = data["request_id"], data["lease_id"], data["ts"], data["nonce"]
        if not all(isinstance(v, str) for v in (kind, mac, request_id, lease_id, nonce)):
            raise ValueError("ids, nonce and mac must be strings")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            raise ValueError("ts must be a number")
        if kind == "Release" and set(data) == {"request_id", "lease_id", "ts", "nonce"}:
            msg: ControlMessage = Release(request_id, lease_id)
        elif kind == "Reject" and set(data) == {"request_id", "lease_id", "ts", "nonce", "reason"}:
            if not isinstance(data["reason"], str):
                raise ValueError("reason must be a string")
            msg = Reject(request_id, lease_id, data["reason"])
        else:
            raise ValueError(f"unknown message type or fields: {kind!r}")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise InvalidMessage("malformed", str(e)[:200]) from None
    return msg, {"type": kind, **data}, mac


class ControlServer:
    """Owns one prefill replica's control port, its secret and the nonces it has seen;
    calls `handler` once per authenticated message (on the server's thread)."""

    def __init__(
        self,
        handler: Callable[[ControlMessage], None],
        host: str,
        port: int = 0,
        *,
        max_connections: int = MAX_CONNECTIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._handler = handler
        self.host = host
        self._secret = secrets.token_bytes(32)
        self._clock = clock
        self._max_connections = max_connections
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._conns: OrderedDict[int, asyncio.StreamWriter] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped: Counter[str] = Counter()  # reason -> messages or connections refused
        self.accepted = 0
        # Its own loop on its own thread: the caller may be running an event loop already.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-control", daemon=True)
        self._thread.start()
        start = asyncio.start_server(self._serve, host, port, limit=MAX_LINE_BYTES)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]

    def lease_key(self, lease_id: str) -> bytes:
        """The key that authorizes Release / Reject of one lease (travels in its handle)."""
        return hmac.new(self._secret, lease_id.encode(), hashlib.sha256).digest()

    def verify(self, line: bytes) -> ControlMessage:
        """The message `line` carries, if authentic, fresh and new; else InvalidMessage."""
        msg, payload, mac = _parse(line)
        if not hmac.compare_digest(_mac(self.lease_key(msg.lease_id), payload), mac):
            raise InvalidMessage("unauthenticated", f"bad mac for lease {msg.lease_id[:12]}")
        now = self._clock()
        if abs(now - payload["ts"]) > TIMESTAMP_WINDOW_S:
            raise InvalidMessage("stale", f"timestamp {payload['ts']:.0f} is outside the window")
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) < now:
                self._nonces.popitem(last=False)
            if payload["nonce"] in self._nonces:
                raise InvalidMessage("replayed", "nonce already seen")
            self._nonces[payload["nonce"]] = now + 2 * TIMESTAMP_WINDOW_S
        return msg

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = id(writer)
        self._conns[conn] = writer
        while len(self._conns) > self._max_connections:  # the oldest makes room
            _, oldest = self._conns.popitem(last=False)
            self.dropped["evicted"] += 1
            oldest.close()
        try:
            line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            if not line.endswith(b"\n"):
                raise InvalidMessage("malformed", "no complete line")
            msg = self.verify(line)
            self._handler(msg)
            self.accepted += 1
            writer.write(b"ok\n")
            await writer.drain()
        except InvalidMessage as e:
            self.dropped[e.reason] += 1
            log.warning("control message dropped: %s", e)
        except (asyncio.LimitOverrunError, ValueError):
            self.dropped["oversized"] += 1
        except TimeoutError:
            self.dropped["timeout"] += 1
        except (ConnectionError, OSError):
            pass
        except Exception:
            log.exception("control message handler failed")
        finally:
            self._conns.pop(conn, None)
            writer.close()

    def stats(self) -> dict[str, int]:
        return {"control_accepted": self.accepted, **{f"control_dropped_{k}": v for k, v in self.dropped.items()}}

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for w in list(self._conns.values()):
                w.close()
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        except Exception:
            log.exception("control server close failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def send(address: tuple[str, int], msg: ControlMessage, key: bytes, timeout_s: float = 2.0) -> bool:
    """Deliver `msg` signed with its lease's `key`; False (logged) when the owner is
    unreachable or refused it: the lease then expires."""
    try:
        with socket.create_connection(address, timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(encode(msg, key))
            return sock.makefile("rb").readline() == b"ok\n"
    except OSError as e:
        log.warning("control message %s to %s failed: %s", type(msg).__name__, address, e)
        return False
