"""duet across three Ray nodes (head, prefill, decode), each in its own
network namespace, deployed from the Helm chart's rendered `serveConfigV2` with the
NIXL backend over UCX's TCP transport.

Greedy output equals the single-process engine's; each pool runs on its own node and
the transfer is counted there (each node's own metrics agent); the prefix index and
the KV tier live in a Redis reached over the bridge; HTTP enters through the head's
HAProxy, which forwards it to the decode replica (the gateway runs inside it). An engine
core child killed on the decode node mid-stream, then on the prefill node, costs no
request (each replica starts a new one in place). Then the decode node is killed
mid-stream: the stream ends (the connection to its ingress replica is gone) and never
hangs, the prefill node's leases go back to zero, and once the node is back the
cluster serves exactly again.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from mn_cluster import (
    BYTES_PER_BLOCK,
    CHAT,
    MAX_TOKENS,
    DuetServe,
    cluster_config,
    complete_unique,
    scrape,
    settled,
    total,
    wait_for,
)

from cluster.serve_config import serve_config

pytestmark = pytest.mark.multinode

helm_chart = pytest.importorskip("helm_chart", reason="the chart tests' helpers (tests/helm_chart.py)")
pytest.importorskip("helm_python", reason="Helm's engine (PyPI helm-python-sdk)")

EXAMPLE = "cpu-small.yaml"


@pytest.fixture(scope="module")
def duet(mn, mn_redis, tmp_path_factory):
    """The chart rendered with this cluster's `duet:` settings; its serveConfigV2
    deployed as KubeRay would deploy it (here: `duet serve --serve-config`)."""
    values = helm_chart.load_values(helm_chart.CHART / "examples" / EXAMPLE)
    values["duet"] = cluster_config(mn, mn_redis, "nixl")
    values["redis"] = {"enabled": False, "externalUrl": mn_redis}  # the bridge's, not a StatefulSet
    rendered = helm_chart.serve_config_v2(helm_chart.render(values))
    path = tmp_path_factory.mktemp("chart") / "serveConfigV2.yaml"
    path.write_text(yaml.safe_dump(rendered))
    d = DuetServe(mn, ["--serve-config", str(path)], path.with_name("serve.log"))
    d.rendered = rendered
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


def test_the_rendered_chart_deploys_what_duet_generates(duet, mn, mn_redis):
    from cluster.config import ClusterConfig

    generated = serve_config(ClusterConfig.model_validate(cluster_config(mn, mn_redis, "nixl")))
    assert helm_chart.same_serve_config(duet.rendered, generated)


def test_greedy_output_is_exact_across_nodes(duet, mn, reference, chat):
    for stream in (False, True):
        text, prompt_tokens = chat(duet.url, stream=stream)
        assert text == reference.text
        assert prompt_tokens == reference.prompt_tokens


def test_each_pool_runs_and_counts_on_its_own_node(duet, mn):
    def placed() -> dict | None:
        nodes = {n: scrape(mn, n) for n in ("head", "prefill", "decode")}
        # The gateway counts its requests where it runs: in the decode replica.
        seen = (total(nodes["decode"], "ray_duet_requests_total", pool="gateway") > 0
                and total(nodes["prefill"], "ray_duet_kv_blocks_total", pool="prefill") > 0
                and total(nodes["decode"], "ray_duet_kv_blocks_total", pool="decode") > 0)
        return nodes if seen else None  # replicas export every second: wait for it

    nodes = wait_for(placed, 30, "each pool's series on its own node")
    for other in ("head", "decode"):
        assert total(nodes[other], "ray_duet_kv_blocks_total", pool="prefill") == 0
    for other in ("head", "prefill"):
        assert total(nodes[other], "ray_duet_kv_blocks_total", pool="decode") == 0

    before = {"prefill": settled(mn, "prefill", "ray_duet_kv_leases_granted_total"),
              "decode": settled(mn, "decode", "ray_duet_kv_transfer_bytes_total")}
    prompt_tokens = complete_unique(duet.url)
    want = math.ceil(prompt_tokens / 16) * BYTES_PER_BLOCK  # no block of it cached anywhere: all of it moves

    def moved() -> bool:
        d = {n: scrape(mn, n) for n in ("prefill", "decode")}
        pulled = (total(d["decode"], "ray_duet_kv_transfer_bytes_total", backend="nixl")
                  - total(before["decode"], "ray_duet_kv_transfer_bytes_total", backend="nixl"))
        leased = (total(d["prefill"], "ray_duet_kv_leases_granted_total")
                  - total(before["prefill"], "ray_duet_kv_leases_granted_total"))
        return pulled == want and leased == 1 and total(d["prefill"], "ray_duet_kv_transfer_bytes_total") == 0

    wait_for(moved, 30, f"{want} bytes pulled on the decode node, one lease granted on the prefill node")


def test_prefix_index_and_kv_tier_are_in_the_bridge_redis(duet, mn_redis, chat):
    chat(duet.url, content="A prompt long enough to fill more than one KV block for the tier to store " * 3)
    index, tier = (redis.Redis.from_url(f"{mn_redis}/{db}") for db in (0, 1))
    wait_for(lambda: index.dbsize() > 0 and tier.dbsize() > 0, 30, "prefix index and LMCache keys in Redis")


def _kill_engine_core(mn, node: str) -> int:
    """SIGKILL the engine core child (engine/core_process.py) running on `node`."""
    cores = [pid for pid in mn.pids(node) if b"engine.core_process" in _cmdline(pid)]
    assert len(cores) == 1, f"engine cores on {node}: {cores}"
    os.kill(cores[0], signal.SIGKILL)
    return cores[0]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended while we looked
        return b""


def test_an_engine_core_killed_on_either_node_costs_no_request(duet, mn, reference, chat):
    """The decode node's engine core dies mid-stream: the replica starts a new one in
    place and the stream ends with the exact answer; then the prefill node's: the next
    request is exact too (decode prefills locally, or waits for the new core)."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": CHAT}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, done, killed = "", False, None
    with httpx.stream("POST", f"{duet.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
            if killed is None and text:
                killed = _kill_engine_core(mn, "decode")
    assert killed is not None and done and text == reference.text

    _kill_engine_core(mn, "prefill")
    assert chat(duet.url, timeout=120)[0] == reference.text
    assert chat(duet.url, stream=True, timeout=120)[0] == reference.text


def test_losing_the_decode_node_mid_stream_errors_and_the_cluster_recovers(duet, mn, reference, chat):
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    events: list[str] = []
    # A hang is a ReadTimeout: no byte for 120 s. The decode replica is the stream's
    # HTTP ingress: with its node gone the stream ends, cut or with an error event.
    ended_by = None
    try:
        with httpx.stream("POST", f"{duet.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 5:
                        mn.kill_node("decode")
    except httpx.TimeoutException:
        raise
    except httpx.HTTPError as e:
        ended_by = e
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert ended_by is not None or errors, events[-3:]  # cut, or told in the stream it is reading
    assert "[DONE]" not in events

    def no_leases() -> bool:
        s = scrape(mn, "prefill")
        return "ray_duet_kv_leases_active" in s and total(s, "ray_duet_kv_leases_active") == 0

    wait_for(no_leases, 60, "the prefill node's leases back to zero")

    mn.start_node("decode")  # a new node; Serve places the decode replica there

    def serves() -> bool:
        text, _ = chat(duet.url, timeout=60)
        return text == reference.text

    wait_for(serves, 300, "an exact answer with the decode node back", interval=2)
