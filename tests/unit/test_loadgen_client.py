"""The streaming client and a whole sweep against an in-process fake server."""

import json

import httpx
import pytest

from loadgen.arrivals import ArrivalProcess
from loadgen.bench import BenchConfig, run_sweep
from loadgen.client import OpenAIClient
from loadgen.distributions import parse_length
from loadgen.metrics import parse_goodput
from loadgen.records import Outcome, RequestResult
from loadgen.testing import WordTokenizer, fake_server
from loadgen.workloads import WorkloadSpec

pytestmark = pytest.mark.unit


def result(max_tokens=4, ignore_eos=True):
    return RequestResult(0, 0, prompt_tokens=3, max_tokens=max_tokens, ignore_eos=ignore_eos)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_stream_records_every_chunk(endpoint):
    async with OpenAIClient("http://fake/v1", "m", endpoint, transport=fake_server()) as c:
        body = c.body("hi", 4, True)
        assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
        r = await c.send("hi", result())
        info = await c.server_info()
    assert r.outcome is Outcome.COMPLETED and r.finish_reason == "length"
    assert len(r.chunk_times) == 4 and r.text == "w0 w1 w2 w3 "  # role-only chat delta not timed
    assert r.usage["completion_tokens"] == 4
    assert r.send_time < r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
    assert info["models"]["data"][0]["id"] == "fake-model"


async def test_rejected_cut_and_timed_out_requests_are_kept():
    async with OpenAIClient("http://fake", "m", transport=fake_server(mode="reject")) as c:
        r = await c.send("hi", result())
    assert r.outcome is Outcome.FAILED and r.http_status == 429 and "queue full" in r.error
    async with OpenAIClient("http://fake", "m", transport=fake_server(mode="cut")) as c:
        r = await c.send("hi", result())
    assert r.outcome is Outcome.UNFINISHED and len(r.chunk_times) == 4
    async with OpenAIClient("http://fake", "m", timeout_s=0.05, transport=fake_server(mode="hang")) as c:
        r = await c.send("hi", result())
    assert r.outcome is Outcome.UNFINISHED and "timeout" in r.error


@pytest.mark.parametrize("arrival", [ArrivalProcess(rate=200.0, seed=1), ArrivalProcess(concurrency=3)])
async def test_sweep_point_against_fake_server(arrival):
    wl = WorkloadSpec("multi-turn", 7, parse_length("5"), parse_length("3"), seed=3, ignore_eos=True)
    cfg = BenchConfig("http://fake", None, "chat", wl, [arrival], parse_goodput(["ttft:10000"]),
                      warmup=2, timeout_s=5, progress=False, transport=fake_server())
    [point] = await run_sweep(cfg, WordTokenizer(), log=lambda *_: None)
    m = point["metrics"]
    assert m["submitted"] == 7 and m["completed"] == 7 and m["good"] == 7  # warm-up excluded
    assert m["total_output_tokens"] == 21
    assert point["run"]["model"] == "fake-model" and point["workload"]["output_len_mode"] == "forced"
    # history grows: the second turn's prompt holds turn 1 (5) + its answer (3) + turn 2 (5)
    turn2 = [r for r in point["requests"] if r["turn"] == 1]
    assert turn2 and all(r["prompt_tokens"] == 13 for r in turn2)


@pytest.mark.parametrize("same_prompts", [False, True])
async def test_sweep_points_and_warmup_do_not_share_prompts(same_prompts):
    """A prefix cache must not serve a point's prompts from the warm-up or an earlier
    point, unless --same-prompts asks for exactly that."""
    sent: list[str] = []
    inner = fake_server()

    async def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/models":
            sent.append(json.loads(request.content)["prompt"])
        return await inner.handle_async_request(request)

    wl = WorkloadSpec("random", 4, parse_length("uniform:3:9"), parse_length("2"), seed=5)
    cfg = BenchConfig("http://fake", None, "completions", wl, [ArrivalProcess(concurrency=1)] * 2,
                      warmup=1, progress=False, transport=httpx.MockTransport(recording),
                      same_prompts=same_prompts)
    points = await run_sweep(cfg, WordTokenizer(), log=lambda *_: None)
    warm, first, second = sent[0], sent[1:5], sent[6:10]
    assert sent[5] == warm and warm not in first + second
    assert (set(first) == set(second)) is same_prompts
    assert [r["prompt_tokens"] for r in points[0]["requests"]] == [r["prompt_tokens"] for r in points[1]["requests"]]
    assert all(r["start_ms"] >= 0 for p in points for r in p["requests"])
