"""The lease control channel: decode tells the prefill replica that owns a lease
to `Release` or `Reject` it.

Each prefill replica listens on one TCP port; its address travels in the
`KVHandle`. Messages are single JSON lines (never pickle from the network), one
connection each, with a timeout on every socket operation: nothing waits forever.
A lost message is not fatal: the lease then ends by TTL.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import asdict

from kvtransfer.messages import Reject, Release

log = logging.getLogger(__name__)

ControlMessage = Release | Reject


def encode(msg: ControlMessage) -> bytes:
    return (json.dumps({"type": type(msg).__name__, **asdict(msg)}) + "\n").encode()


def decode(line: bytes) -> ControlMessage:
    data = json.loads(line)
    kind = data.pop("type")
    if kind == "Release":
        return Release(**data)
    if kind == "Reject":
        return Reject(**data)
    raise ValueError(f"unknown control message {kind!r}")


class ControlServer:
    """Owns the listening socket of one prefill replica and calls `handler` per message."""

    def __init__(self, handler: Callable[[ControlMessage], None], host: str = "0.0.0.0", port: int = 0):
        outer = self

        class _Handler(socketserver.StreamRequestHandler):
            timeout = 5.0

            def handle(self):
                try:
                    line = self.rfile.readline(65536)
                    if line:
                        outer._handler(decode(line))
                        self.wfile.write(b"ok\n")
                except Exception:
                    log.exception("bad control message")

        self._handler = handler
        self._server = socketserver.ThreadingTCPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def send(address: tuple[str, int], msg: ControlMessage, timeout_s: float = 2.0) -> bool:
    """Deliver `msg`; False (logged) when the owner is unreachable: its lease expires."""
    try:
        with socket.create_connection(address, timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(encode(msg))
            return sock.makefile("rb").readline() == b"ok\n"
    except OSError as e:
        log.warning("control message %s to %s failed: %s", type(msg).__name__, address, e)
        return False
