"""Traces and metrics of a real disaggregated cluster.

One streamed chat request is one trace: the gateway's SERVER span, a routing span per
pool, the prefill replica's span (queue, compute), and the decode replica's span with
its KV transfer, from three processes under one trace id, joined by the W3C context
the typed messages carry. Spans go to an OTLP/HTTP sink inside the test
(telemetry/otlp_sink.py, decoding the protobuf). Metrics are read where Prometheus
reads a Ray cluster's: the Ray metrics agent of the node.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from duet_cluster import BLOCK_SIZE, BYTES_PER_BLOCK, METRICS_PORT, TRACED_DECODE_BLOCKS, wait_for, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from telemetry import metrics
from telemetry.otlp_sink import OTLPSink

pytestmark = [pytest.mark.integration, pytest.mark.cluster("traced")]

SERVER, CLIENT = 2, 3
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture
def sink(otlp_sink) -> OTLPSink:
    return otlp_sink


@pytest.fixture
def traced(duet):
    """The traced cluster (its sink listens for the whole session: conftest.py)."""
    return duet


def _stream_chat(duet, body: dict, headers: dict | None = None) -> str:
    """Streams one chat completion; returns its id (the request id on every span)."""
    with httpx.stream("POST", f"{duet.url}/v1/chat/completions", json={**body, "stream": True},
                      headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[0])["id"]


# The process that takes the HTTP request: a decode replica, with the gateway inside.
INGRESS = "gateway+decode"


def _spans_of(sink: OTLPSink, request_id: str, names: set[str]) -> dict:
    """The request's spans by name, once `names` and the gateway's SERVER span have
    all arrived (each process exports its own batches, in no particular order)."""
    def complete():
        root = sink.find(**{"duet.request_id": request_id})
        if not root:
            return None
        spans = sink.trace(root[0].trace_id)
        has_root = any(s.component == INGRESS and s.kind == SERVER for s in spans)
        return spans if has_root and names <= {s.name for s in spans} else None

    spans = wait_for(complete, 60, what=f"spans {sorted(names)} of {request_id}")
    return {s.name: s for s in spans}


def test_one_streamed_chat_is_one_trace_across_gateway_prefill_and_decode(traced, sink):
    model = traced.cfg.engine.model.rsplit("/", 1)[-1]
    rid = _stream_chat(traced, CHAT)
    root_name = wait_for(
        lambda: next((s.name for s in sink.find(**{"duet.request_id": rid}) if s.name.startswith("chat ")), None),
        60, what="the gateway's span",
    )
    names = {root_name, "route prefill", "prefill", "prefill.queue", "prefill.compute",
             "decode", "kv_transfer", "decode.queue", "decode.compute"}
    spans = _spans_of(sink, rid, names)
    root = spans[root_name]
    assert len({s.trace_id for s in spans.values()}) == 1
    assert root.parent_span_id is None and root.kind == SERVER and root.component == INGRESS
    assert model.lower() in root_name.lower() or root.attributes["gen_ai.request.model"] in root_name
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["duet.status"] == "ok"
    assert a["duet.ttft_ms"] > 0 and a["duet.tpot_ms"] > 0

    # Who is whose child, and which process sent it.
    parents = {name: s.parent_span_id for name, s in spans.items()}
    for child in ("route prefill", "prefill", "decode"):
        assert parents[child] == root.span_id, child
    for child in ("prefill.queue", "prefill.compute"):
        assert parents[child] == spans["prefill"].span_id
    for child in ("kv_transfer", "decode.queue", "decode.compute"):
        assert parents[child] == spans["decode"].span_id
    components = {name: s.component for name, s in spans.items()}
    # The gateway runs in the decode replica: it routes the prefill and decodes itself.
    assert components["route prefill"] == components["decode"] == INGRESS
    assert components["prefill"] == "prefill"
    assert "route decode" not in spans

    route = spans["route prefill"].attributes
    assert route["duet.route.replica"].startswith("prefill#") and route["duet.route.reason"]
    assert route["duet.route.candidates"] and "duet.route.overlap_blocks" in route
    prefill = spans["prefill"].attributes
    assert prefill["duet.queue_ms"] >= 0
    assert prefill["duet.kv_blocks"] == -(-a["gen_ai.usage.input_tokens"] // BLOCK_SIZE)
    transfer = spans["kv_transfer"]
    assert transfer.kind == CLIENT and transfer.attributes["duet.transfer.result"] == "released"
    assert transfer.attributes["duet.transfer.backend"] == traced.cfg.transfer.backend
    assert transfer.attributes["duet.transfer.bytes"] == prefill["duet.kv_blocks"] * BYTES_PER_BLOCK
    decode = spans["decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == 5  # the first came from prefill
    assert decode["duet.import_wait_ms"] >= transfer.duration_ms * 0.5

    # The same prompt again: prefill finds its blocks in its own prefix cache.
    rid2 = _stream_chat(traced, CHAT)
    again = _spans_of(sink, rid2, {"prefill"})["prefill"].attributes
    assert again["duet.cached_tokens.pool"] > 0
    assert again["gen_ai.usage.cache_read.input_tokens"] == again["duet.cached_tokens.pool"]
    wait_idle(traced)


def test_a_client_traceparent_is_continued(traced, sink):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    rid = _stream_chat(traced, CHAT, {"traceparent": f"00-{trace_id}-{parent}-01"})
    spans = _spans_of(sink, rid, {"prefill", "decode", "kv_transfer"})
    assert {s.trace_id for s in spans.values()} == {trace_id}
    # The decode span is a SERVER span of the same process: the root is the request's.
    root = next(s for s in spans.values() if s.name.startswith("chat "))
    assert root.component == INGRESS and root.kind == SERVER and root.parent_span_id == parent


def test_a_refused_import_is_a_failed_transfer_on_the_trace(traced, sink):
    # Other tests of this cluster are refused too (test_handoff.py): count from here.
    seen = len(sink.find(**{"duet.transfer.result": "rejected"}))
    refused = _sum(_scrape(), "ray_duet_kv_transfer_failures_total", pool="decode", reason="no_free_blocks")
    long_prompt = " ".join(["blue green red"] * 120)  # > TRACED_DECODE_BLOCKS blocks of tokens
    r = httpx.post(f"{traced.url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 4}, timeout=120)
    assert r.status_code == 503, r.text
    spans = wait_for(lambda: sink.find(**{"duet.transfer.result": "rejected"})[seen:], 60,
                     what="a rejected transfer span")
    assert spans[0].status_code == 2 and spans[0].attributes["duet.transfer.blocks"] > TRACED_DECODE_BLOCKS
    wait_for(lambda: _sum(_scrape(), "ray_duet_kv_transfer_failures_total", pool="decode",
                          reason="no_free_blocks") >= refused + 1,
             30, what="the refused import counted by reason")
    wait_idle(traced)


# ------------------------------------------------------------------ metrics
def _scrape() -> dict[str, list[tuple[dict, float]]]:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _sum(scraped: dict, name: str, **labels) -> float:
    return sum(v for lab, v in scraped.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


# Counted per request: (series, labels) -> how many per request.
PER_REQUEST = {
    ("ray_duet_ttft_seconds_count", ("pool", "gateway")): 1,
    ("ray_duet_tpot_seconds_count", ("pool", "gateway")): 1,
    ("ray_duet_e2e_seconds_count", ("pool", "gateway")): 1,
    ("ray_duet_requests_total", ("pool", "gateway")): 1,
    ("ray_duet_disaggregation_decisions_total", ("pool", "gateway")): 1,  # where=remote, reason=always
    ("ray_duet_output_tokens_total", ("pool", "gateway")): CHAT["max_tokens"],
    ("ray_duet_router_decisions_total", ("pool", "prefill")): 1,
    ("ray_duet_router_overlap_blocks_count", ("pool", "prefill")): 1,
    ("ray_duet_queue_wait_seconds_count", ("pool", "prefill")): 1,
    ("ray_duet_queue_wait_seconds_count", ("pool", "decode")): 1,
    ("ray_duet_kv_transfer_seconds_count", ("pool", "decode")): 1,
}


def _settled_scrape() -> dict[str, list[tuple[dict, float]]]:
    """A scrape after the earlier tests' last observations have reached the agent:
    replicas report every second, so wait until the per-request series stop moving
    across two scrapes more than a report interval apart."""
    seen = [_scrape()]

    def settled():
        time.sleep(1.5)
        seen.append(_scrape())
        a, b = seen[-2:]
        return b if all(_sum(a, k[0], **dict([k[1]])) == _sum(b, k[0], **dict([k[1]])) for k in PER_REQUEST) else None

    return wait_for(settled, 60, interval=0, what="the earlier tests' metrics to settle")


def test_metrics_reach_the_ray_metrics_agent_with_pool_and_replica_labels(traced):
    before = _settled_scrape()
    n = 3
    for i in range(n):
        body = {**CHAT, "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}
        if i % 2:
            _stream_chat(traced, body)
        else:
            assert httpx.post(f"{traced.url}/v1/chat/completions", json=body, timeout=120).status_code == 200

    def counted():
        now = _scrape()
        got = {k: _sum(now, k[0], **dict([k[1]])) - _sum(before, k[0], **dict([k[1]])) for k in PER_REQUEST}
        return now if got == {k: n * per for k, per in PER_REQUEST.items()} else None

    try:
        now = wait_for(counted, 60, what="every per-request series counting the requests sent")
    except AssertionError:
        now = _scrape()
        got = {k: _sum(now, k[0], **dict([k[1]])) - _sum(before, k[0], **dict([k[1]])) for k in PER_REQUEST}
        raise AssertionError(f"deltas after {n} requests: {got}") from None

    # Every family a healthy run records is there, with pool and replica labels.
    # (Preemptions, LMCache tier hits, transfer failures, migrations, moves, prefill retries and
    # speculative drafts and forked choices appear once they happen: Ray exports no zero counter.)
    # The autoscaling families come from the goodput policy, which this cluster does not
    # run (tests/integration/test_autoscaling.py reads them).
    quiet = {metrics.PREEMPTIONS.name, metrics.TIER_HIT_TOKENS.name, metrics.TRANSFER_FAILURES.name,
             metrics.MIGRATIONS.name, metrics.MOVES.name, metrics.PREFILL_RETRIES.name, metrics.AUTOSCALE_DESIRED.name,
             metrics.AUTOSCALE_CURRENT.name, metrics.AUTOSCALE_DECISIONS.name, metrics.SPEC_DRAFT_TOKENS.name,
             metrics.SPEC_ACCEPTED_TOKENS.name, metrics.SPEC_VERIFY_STEPS.name, metrics.FORKS.name,
             metrics.ENGINE_RESTARTS.name, metrics.ENGINE_RESTART_FAILURES.name}
    for family in metrics.FAMILIES:
        if family.name in quiet:
            continue
        series = f"ray_{family.name}" + ("_count" if family.kind == "histogram" else "")
        assert series in now, series
        labels = now[series][0][0]
        assert {"pool", "replica", *family.labels} <= set(labels), (series, labels)
    # The replicas that answered these requests, the decode replicas the gateway runs in
    # (Ray's agent still exports the series of earlier configs' replicas).
    earlier = {tuple(sorted(lab.items())): v for lab, v in before.get("ray_duet_ttft_seconds_count", [])}
    gateway_replicas = {lab["replica"] for lab, v in now["ray_duet_ttft_seconds_count"]
                        if v > earlier.get(tuple(sorted(lab.items())), 0)}
    assert gateway_replicas and all(r.startswith("decode#") for r in gateway_replicas), gateway_replicas
    assert _sum(now, "ray_duet_kv_blocks_total", pool="decode") >= TRACED_DECODE_BLOCKS


def test_a_burst_of_scrapes_leaves_nothing_in_flight_in_the_routers(traced):
    """Each gateway `/metrics` asks the prefill pool for its stats through the pool's
    router (the decode pool is the gateway's own replica), and Serve can report such a
    short call complete before it reports it routed: it must not stay in the router's
    in-flight count (load on its replica for good). Once the burst is over, every replica's count is back to 0."""
    from concurrent.futures import ThreadPoolExecutor

    # One request first, so the prefill router has a replica it sent a call to.
    r = httpx.post(f"{traced.url}/v1/chat/completions", json=CHAT, timeout=120)
    assert r.status_code == 200, r.text

    def scrape(_: int) -> str:
        r = httpx.get(f"{traced.url}/metrics", timeout=60)
        assert r.status_code == 200
        return r.text

    with ThreadPoolExecutor(8) as pool:
        pages = list(pool.map(scrape, range(160)))
    assert "duet_router_in_flight" in pages[-1]

    def in_flight() -> dict[str, float]:
        families = text_string_to_metric_families(scrape(0))
        return {f"{s.labels['pool']}/{s.labels['replica']}": s.value
                for f in families if f.name == "duet_router_in_flight" for s in f.samples}

    seen: dict[str, float] = {}

    def idle() -> bool:
        seen.clear()
        seen.update(in_flight())
        return "prefill" in {key.split("/")[0] for key in seen} and not any(seen.values())

    try:
        wait_for(idle, 30, what="no call in flight in the gateway's routers")
    except AssertionError as e:
        raise AssertionError(f"{e}; last counts {seen}") from None
