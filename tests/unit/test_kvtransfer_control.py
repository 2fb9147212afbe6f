"""The lease control channel: only an authentic, fresh, first-seen message for a
lease ends it. Forged, replayed, stale, malformed or huge messages from a raw socket
change nothing and are counted; a flood of idle connections does not stop the real
path. Real sockets on loopback, the real `KVExporter` and `LeaseTable`."""

from __future__ import annotations

import json
import socket
import time

import pytest
from test_kvtransfer_handoff import InProcessBackend  # tests/unit is on sys.path (rootdir conftest)

from kvtransfer import control
from kvtransfer.handoff import KVExporter, reject_lease, release_lease
from kvtransfer.messages import Reject, RejectReason, Release

pytestmark = pytest.mark.unit


@pytest.fixture
def exporter():
    freed: list[tuple[int, ...]] = []
    backend = InProcessBackend("prefill-0", "m")
    import torch

    backend.register(torch.zeros(16, 2, 2, 4, 1, 8))
    ex = KVExporter(backend, "prefill-0", freed.append, lease_ttl_s=60, host="127.0.0.1")
    ex.freed = freed
    yield ex
    ex.close()


def _live(ex: KVExporter, rid: str = "r1"):
    ex.grant(rid, [3, 4])
    return ex.handle_for(rid, num_tokens=8)


def _raw(address, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(data)
        return s.makefile("rb").readline() if read else b""


def _wait_dropped(ex: KVExporter, reason: str, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while ex.control.dropped[reason] < n:
        assert time.monotonic() < deadline, dict(ex.control.dropped)
        time.sleep(0.01)


def test_an_authentic_release_ends_the_lease(exporter):
    h = _live(exporter)
    assert release_lease(h, timeout_s=5)
    assert exporter.freed == [(3, 4)] and len(exporter.leases) == 0
    assert exporter.stats()["control_accepted"] == 1


def test_reads_are_expected_from_a_grant_until_the_last_lease_ends(exporter):
    assert not exporter.backend.expecting
    first, second = _live(exporter, "r1"), _live(exporter, "r2")
    assert exporter.backend.expecting and exporter.backend.reads_expected[0] == 60
    assert release_lease(first, timeout_s=5)
    assert exporter.backend.expecting  # r2 may still be pulled
    assert reject_lease(second, RejectReason.CLIENT_DISCONNECTED, timeout_s=5)
    assert not exporter.backend.expecting
    exporter.grant("r3", [5])
    assert exporter.backend.expecting and exporter.withdraw("r3") and not exporter.backend.expecting


def test_a_lease_whose_caller_left_is_withdrawn(exporter):
    # The engine granted it as the prefill call was cancelled: no handle ever left.
    exporter.grant("r1", [3, 4])
    assert exporter.withdraw("r1") and exporter.freed == [(3, 4)]
    assert not exporter.withdraw("r1") and not exporter.withdraw("never-leased")
    assert len(exporter.leases) == 0


def test_reject_is_authenticated_too(exporter):
    h = _live(exporter)
    assert reject_lease(h, RejectReason.CLIENT_DISCONNECTED, timeout_s=5)
    assert exporter.leases.counters().rejected == 1


@pytest.mark.parametrize(
    "forge, reason",
    [
        (lambda h, addr: json.dumps({"type": "Release", "request_id": h.request_id, "lease_id": h.lease_id}) + "\n",
         "malformed"),  # no mac at all
        (lambda h, addr: control.encode(Release(h.request_id, h.lease_id), b"\0" * 32).decode(), "unauthenticated"),
        (lambda h, addr: control.encode(Reject(h.request_id, h.lease_id, "x"), b"guess").decode(), "unauthenticated"),
        (lambda h, addr: control.encode(Release(h.request_id, h.lease_id), bytes.fromhex(h.control_key),
                                        now=time.time() - 3600).decode(), "stale"),
        (lambda h, addr: "not json\n", "malformed"),
        (lambda h, addr: "[" * 3000 + "\n", "malformed"),
        (lambda h, addr: "x" * 100_000 + "\n", "oversized"),
    ],
)
def test_a_forged_message_with_a_live_lease_id_frees_nothing(exporter, forge, reason):
    h = _live(exporter)
    assert _raw(tuple(h.control_address), forge(h, h.control_address).encode()) == b""
    _wait_dropped(exporter, reason)
    assert exporter.freed == [] and len(exporter.leases) == 1
    assert release_lease(h, timeout_s=5)  # the real path still works
    assert exporter.freed == [(3, 4)]


def test_a_replayed_message_is_refused(exporter):
    h1, h2 = _live(exporter, "r1"), _live(exporter, "r2")
    line = control.encode(Release(h1.request_id, h1.lease_id), bytes.fromhex(h1.control_key))
    assert _raw(tuple(h1.control_address), line) == b"ok\n"
    assert _raw(tuple(h1.control_address), line) == b""
    _wait_dropped(exporter, "replayed")
    # A key authorizes its own lease only: h1's key cannot end h2's lease.
    forged = control.encode(Release(h2.request_id, h2.lease_id), bytes.fromhex(h1.control_key))
    assert _raw(tuple(h2.control_address), forged) == b""
    _wait_dropped(exporter, "unauthenticated")
    assert len(exporter.leases) == 1


def test_a_flood_of_idle_connections_does_not_stop_the_real_path(exporter):
    h = _live(exporter)
    idle = [socket.create_connection(tuple(h.control_address), timeout=5) for _ in range(3 * control.MAX_CONNECTIONS)]
    try:
        assert release_lease(h, timeout_s=5)
        assert exporter.freed == [(3, 4)]
    finally:
        for s in idle:
            s.close()
    assert exporter.control.dropped["evicted"] > 0


async def test_a_server_starts_inside_a_running_event_loop():
    """Serve constructs replicas inside its event loop."""
    server = control.ControlServer(lambda msg: None, host="127.0.0.1")
    try:
        assert server.port > 0
    finally:
        server.close()
