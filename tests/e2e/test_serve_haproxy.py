"""`duet serve --mode aggregated --replicas 2`: each
aggregated replica runs the gateway and its own HTTP server, and HAProxy, not Serve's
Python proxy, carries each connection to one of them, so a streamed token crosses no
Ray hop between processes. HAProxy asks the ingress request router which replica
(routing/router/ingress.py): the KV-aware choice. Its own `duet serve` and Ray, after
the session's server has stopped (`stops_server` tests run last, and this file sorts
after the one that stops it).
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from routing_checks import assert_prefix_routing
from serve_process import PORT, Served, running

pytestmark = [pytest.mark.e2e, pytest.mark.stops_server]

# Where Serve gives the ingress replica its own HTTP server (Ray's range is 30000-31000;
# a narrow one of our own, so the test knows where to look).
DIRECT_PORTS = range(30500, 30510)


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with running(tmp_path_factory.mktemp("haproxy"),
                 args=("--mode", "aggregated", "--replicas", "2"),
                 env={"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(DIRECT_PORTS.start),
                      "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(DIRECT_PORTS.stop)}) as s:
        yield s


def _listener(port: int) -> str:
    """The command line of the process listening on TCP `port` ("" if none), read from
    /proc: the socket's inode in /proc/net/tcp, then the process holding it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def test_haproxy_carries_the_stream_the_replica_writes(direct: Served):
    assert "haproxy" in _listener(PORT), _listener(PORT)
    # Each replica's own HTTP server answers (what HAProxy forwards to), and so does the router's.
    listeners = {p: _listener(p) for p in DIRECT_PORTS}
    replica_ports = [p for p, cmd in listeners.items() if "ServeReplica:duet:aggregated" in cmd]
    assert len(replica_ports) == 2, listeners
    assert sum("ServeReplica:duet:ingress_router" in cmd for cmd in listeners.values()) == 1, listeners
    with urllib.request.urlopen(f"http://127.0.0.1:{replica_ports[0]}/v1/models", timeout=30) as r:
        assert json.load(r)["data"][0]["id"]

    c = openai.OpenAI(base_url=f"{direct.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    whole = c.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    chunks = list(c.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                       temperature=0, stream=True))
    assert len(chunks) > 1  # streamed, not one body
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"response_format": {"type": "nope"}})

    # The gateway's span and the engine's come from one process, which says it is both.
    def traced() -> bool:
        roots = direct.sink.find(**{"duet.request_id": whole.id})
        spans = direct.sink.trace(roots[0].trace_id) if roots else []
        return {"generate"} <= {s.name for s in spans} and {s.component for s in spans} == {"gateway+aggregated"}

    assert direct.sink.wait_for(traced, 60), sorted({(s.component, s.name) for s in direct.sink.spans})


def test_the_ingress_request_router_sends_each_prompt_where_its_prefix_is_cached(direct: Served):
    assert_prefix_routing(direct, "generate")
