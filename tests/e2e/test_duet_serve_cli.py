"""The README's run command for real (the session's `duet serve`, tests/e2e/conftest.py):
it started its own Ray, it serves an OpenAI chat request, the request's spans reach
the sink from every process, and Ctrl-C (SIGINT) stops it and its Ray cleanly.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import pytest
from serve_process import READY_LINE, Served, raylet_pids

pytestmark = pytest.mark.e2e


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_duet_serve_answers_and_traces_every_process(served: Served):
    ready = next(ln for ln in served.log().splitlines() if READY_LINE in ln)
    assert f"{served.url}/v1" in ready
    assert raylet_pids() - served.raylets_before, "duet serve started no Ray of its own"

    c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.chat.completions.create(
        model=c.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens is not None

    # One trace with spans from the decode replica (the gateway runs in it) and prefill.
    def traced() -> bool:
        roots = served.sink.find(**{"duet.request_id": r.id})
        spans = served.sink.trace(roots[0].trace_id) if roots else []
        return {"gateway+decode", "prefill"} <= {s.component for s in spans}

    assert served.sink.wait_for(traced, 60), sorted({(s.component, s.name) for s in served.sink.spans})


@pytest.mark.stops_server
def test_ctrl_c_stops_duet_serve_and_its_ray(served: Served):
    ours = raylet_pids() - served.raylets_before
    assert ours, "duet serve started no Ray of its own"
    served.proc.send_signal(signal.SIGINT)
    rc = served.proc.wait(timeout=90)
    assert rc == 0, served.tail()
    assert "shutting down" in served.log()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in ours) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in ours), "Ray outlived duet serve"
