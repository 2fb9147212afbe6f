"""The chaos soak's client (loadgen/chaos.py) against a fake server: every request is
accounted for (completed, disconnected on purpose, failed, hung), greedy answers are
checked against the reference pass, and faults fire once, in order, at their counts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loadgen.chaos import ChaosSoak, Fault, SoakPlan

pytestmark = pytest.mark.unit


class FakeServer:
    """Answers `max_tokens` words; `wrong` makes greedy answers differ after the reference
    pass, `fail` / `hang` pick requests (by arrival number) to fail or never answer."""

    def __init__(self, fail=(), hang=(), wrong=False):
        self.fail, self.hang, self.wrong, self.calls = set(fail), set(hang), wrong, 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        n, self.calls = self.calls, self.calls + 1
        body = json.loads(request.content)
        if n in self.hang:
            await asyncio.sleep(3600)
        if n in self.fail:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        word = "x" if self.wrong and n >= 32 and body["temperature"] == 0 else body["messages"][1]["content"][:3]
        words = [word] * body["max_tokens"]
        usage = {"completion_tokens": len(words)}
        if not body["stream"]:
            return httpx.Response(200, json={"choices": [{"message": {"content": "".join(words)}}], "usage": usage})
        events = [{"choices": [{"delta": {"content": w}}]} for w in words] + [{"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def _run(server: FakeServer, plan: SoakPlan, faults=()):
    async def go():
        soak = ChaosSoak("http://fake", plan, list(faults), transport=httpx.MockTransport(server))
        try:
            return await soak.run()
        finally:
            await soak.close()

    return asyncio.run(go())


def test_every_request_is_accounted_for_and_faults_fire_in_order():
    fired: list[str] = []
    plan = SoakPlan(num_requests=200, concurrency=8, disconnect_fraction=0.2, seed=3)
    faults = [Fault("second", 120, lambda: fired.append("second")), Fault("first", 50, lambda: fired.append("first"))]
    report = _run(FakeServer(), plan, faults)
    assert fired == ["first", "second"]
    assert [(f.name, f.after, f.error) for f in report.faults] == [("first", 50, None), ("second", 120, None)]
    assert sum(report.outcomes.values()) == 200
    assert report.outcomes.get("failed", 0) == report.outcomes.get("hung", 0) == 0
    assert 25 <= report.disconnects_planned <= 55  # 20% of 200, drawn
    # Streamed ones hang up mid-stream; this server answers the others before they do.
    assert 0 < report.outcomes["disconnected"] <= report.disconnects_planned
    assert report.greedy_checked > 100 and report.greedy_mismatches == report.wrong_lengths == 0


def test_failures_hangs_and_wrong_answers_are_reported():
    plan = SoakPlan(num_requests=40, concurrency=4, disconnect_fraction=0.0, deadline_s=0.5, seed=1)
    # Requests 0-31 are the reference pass; 33 fails and 35 never answers.
    report = _run(FakeServer(fail={33}, hang={35}, wrong=True), plan)
    assert report.outcomes["failed"] == 1 and report.outcomes["hung"] == 1
    assert report.greedy_mismatches == report.greedy_checked > 0
    assert {f["outcome"] for f in report.failures} == {"failed", "hung", "completed"}


def test_a_fault_that_raises_is_recorded_and_the_soak_goes_on():
    def broken():
        raise RuntimeError("no such replica")

    report = _run(FakeServer(), SoakPlan(num_requests=20, concurrency=2), [Fault("kill", 5, broken)])
    assert report.faults[0].error == "RuntimeError: no such replica"
    assert report.outcomes.get("completed", 0) + report.outcomes.get("disconnected", 0) == 20
