"""Goodput autoscaling on a real local cluster (the "autoscaling" config: the goodput
policy on prefill, 1-2 replicas): a burst of long prompts raises the prefill pool,
the load ending lowers it again, every request of the run completes, and the leases
are back at zero. The policy's decisions are in Ray's metrics with their reasons."""

from __future__ import annotations

import threading

import httpx
import pytest
from duet_cluster import APP_NAME, METRICS_PORT, Duet, wait_baseline, wait_for, wait_replicas
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.integration, pytest.mark.cluster("autoscaling")]

CLIENTS = 6
PROMPT_WORDS = 150  # ~560 tokens: a few seconds of prefill each on 2 cores, far over the 1.5 s TTFT SLO queued


def _replicas(pool: str) -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[APP_NAME].deployments[pool].replica_states)


def _decisions(pool: str, direction: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "ray_duet_autoscale_decisions_total"
               and s.labels.get("pool") == pool and s.labels.get("direction") == direction)


class Burst:
    """`CLIENTS` closed-loop clients sending distinct long prompts until stopped."""

    def __init__(self, duet: Duet) -> None:
        self.url = f"{duet.base_url}/completions"
        self.model = duet.cfg.engine.model
        self.stop = threading.Event()
        self.results: list[tuple[int, str]] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _client(self, i: int) -> None:
        words = " ".join(f"w{k}" for k in range(PROMPT_WORDS))
        with httpx.Client(timeout=120) as c:
            n = 0
            while not self.stop.is_set():
                n += 1  # a distinct first word: no prefix-cache hit makes the work smaller
                r = c.post(self.url, json={"model": self.model, "prompt": f"client {i} request {n}: {words}",
                                           "max_tokens": 4})
                self.results.append((r.status_code, r.text[:200]))

    def __enter__(self) -> Burst:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a client hung"


def test_a_burst_of_long_prompts_scales_prefill_up_and_back_down(duet):
    wait_replicas("prefill", 1)
    ups, downs = _decisions("prefill", "up"), _decisions("prefill", "down")
    with Burst(duet) as burst:
        # The policy asks for a second replica, and it starts and serves under the burst.
        wait_for(lambda: sum(_replicas("prefill").values()) == 2, 120, interval=0.5, what="a second prefill replica")
        wait_replicas("prefill", 2, timeout=240)
        served = len(burst.results)
        wait_for(lambda: len(burst.results) >= served + 2 * CLIENTS, 180, interval=0.5,
                 what="requests served with two prefill replicas")
    assert _replicas("decode") == {"RUNNING": 1}  # decode saw no reason to move (and is held at 1)
    # The load has ended: the policy lowers prefill again (its windows empty, then its down delay).
    wait_for(lambda: _replicas("prefill") == {"RUNNING": 1}, 180, interval=1, what="prefill back to one replica")
    failed = [r for r in burst.results if r[0] != 200]
    assert not failed, f"{len(failed)} of {len(burst.results)} requests failed: {failed[:3]}"
    wait_baseline(duet, "prefill")  # no lease left, nothing running, every KV block free
    wait_baseline(duet, "decode")
    wait_for(lambda: _decisions("prefill", "up") > ups and _decisions("prefill", "down") > downs, 60,
             what="the up and down decisions in Ray's metrics")
