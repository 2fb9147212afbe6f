"""`duet serve` as the e2e tests run it: the README's run command in a subprocess with
its own Ray, a config file, and `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at a span sink
in the test process (and nothing in the config), so tracing is on in every process.
The session fixture is in conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from telemetry.otlp_sink import OTLPSink

PORT = 8011  # not 8000 (demo)
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
    """Raylets on this network: the suite may run these tests in a network namespace of
    their own while other Ray clusters run beside them (scripts/test.sh)."""
    ours = os.readlink("/proc/self/ns/net")
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
                net = os.readlink(d / "ns" / "net")
            except OSError:
                continue
            if b"/raylet" in cmd.split(b"\0", 1)[0] and net == ours:
                pids.add(int(d.name))
    return pids


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    sink: OTLPSink
    log_path: Path
    raylets_before: set[int]  # raylets running before `duet serve` started

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def start(root: Path, timeout_s: float = 300, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
          config: str = CONFIG) -> Served:
    """Start `duet serve` with `config` (and `args`, `env`) and wait for its ready line;
    raises RuntimeError (with the log's tail) if it exits or is not ready in time."""
    (root / "cluster.yaml").write_text(config)
    sink = OTLPSink()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           **(env or {})}
    before = raylet_pids()
    with open(root / "serve.log", "w") as f:
        proc = subprocess.Popen(
            [DUET, "serve", "--config", str(root / "cluster.yaml"), "--port", str(PORT), "--ready-timeout", "240",
             *args],
            stdout=f, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
            # A shell running us in the background may ignore SIGINT; the CLI must get it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    s = Served(f"http://127.0.0.1:{PORT}", proc, sink, root / "serve.log", before)
    deadline = time.monotonic() + timeout_s
    while READY_LINE not in s.log():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(s)
            raise RuntimeError(f"duet serve exited ({proc.returncode}) or was not ready "
                               f"in {timeout_s:.0f} s:\n{s.tail()}")
        time.sleep(0.5)
    return s


def stop(s: Served) -> None:
    """SIGTERM if still running (no test stopped it), then the whole process group."""
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(10)
    s.sink.close()


@contextlib.contextmanager
def running(root: Path, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
            config: str = CONFIG) -> Iterator[Served]:
    """A started `duet serve` for a fixture: a start that fails fails the test with its
    log; the server is stopped however the test ends."""
    try:
        s = start(root, args=args, env=env, config=config)
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield s
    finally:
        stop(s)
