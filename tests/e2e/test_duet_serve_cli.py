"""The README's run command for real: `duet serve` in a subprocess starts its own
Ray, serves an OpenAI chat request, and Ctrl-C (SIGINT) stops it and its Ray cleanly.
`OTEL_EXPORTER_OTLP_ENDPOINT` in its environment (and nothing in its config) turns
tracing on in every process: the request's spans reach a sink in this test.

Runs in its own pytest invocation (scripts/test.sh), after the integration suite's
Ray cluster is gone: the CLI starts a fresh one.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from telemetry.otlp_sink import OTLPSink

pytestmark = pytest.mark.e2e

PORT = 8011  # not 8000 (demo) nor 8031 (loadgen e2e)
DUET = str(Path(sys.executable).with_name("duet"))
READY_LINE = "duet is serving"
CONFIG = """\
engine:
  dtype: float32
  num_kv_blocks: 256
  max_model_len: 1024
prefill: {threads: 1}
decode: {threads: 1}
"""


def raylet_pids() -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"/raylet" in cmd.split(b"\0", 1)[0]:
                pids.add(int(d.name))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def sink():
    s = OTLPSink()
    yield s
    s.close()


def test_duet_serve_answers_then_stops_cleanly_on_ctrl_c(tmp_path, sink):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CONFIG)
    before = raylet_pids()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    proc = subprocess.Popen(
        [DUET, "serve", "--config", str(cfg), "--port", str(PORT), "--ready-timeout", "240"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        # A shell running us in the background may ignore SIGINT; the CLI must get it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def read_until(pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                return False
            log.append(line)
            if pred(line):
                return True
        return False

    try:
        assert read_until(lambda ln: READY_LINE in ln, 300), "no ready line:\n" + "".join(log[-40:])
        ready = next(ln for ln in log if READY_LINE in ln)
        assert f"http://127.0.0.1:{PORT}/v1" in ready
        ours = raylet_pids() - before
        assert ours, "duet serve started no Ray of its own"

        c = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(
            model=c.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0,
        )
        assert "Paris" in r.choices[0].message.content
        assert r.usage.prompt_tokens_details.cached_tokens is not None

        # One trace with spans from the gateway, prefill and decode processes.
        def traced() -> bool:
            roots = sink.find(**{"duet.request_id": r.id})
            spans = sink.trace(roots[0].trace_id) if roots else []
            return {"gateway", "prefill", "decode"} <= {s.component for s in spans}

        assert sink.wait_for(traced, 60), sorted({(s.component, s.name) for s in sink.spans})

        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
        read_until(lambda ln: False, 2)
        assert rc == 0, "".join(log[-40:])
        assert any("shutting down" in ln for ln in log)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in ours) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(alive(p) for p in ours), "Ray outlived duet serve"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
