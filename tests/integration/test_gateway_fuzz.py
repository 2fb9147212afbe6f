"""Fuzz the gateway from its own OpenAPI document with Schemathesis: valid and invalid
bodies for every generation endpoint (the request schemas are published in
/openapi.json), streaming and not. No answer may be a 5xx or take longer than the
request timeout; afterwards the cluster answers a valid request and every pool is
back at its baseline (no leaked KV block or lease).

Deterministic: a fixed seed and a bounded number of examples per endpoint.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from duet_cluster import FUZZ_MAX_TOKENS, wait_baseline

pytestmark = [pytest.mark.integration, pytest.mark.cluster("fuzz")]

ST = str(Path(sys.executable).with_name("st"))
EXAMPLES = 30  # per endpoint and phase
REQUEST_TIMEOUT_S = 60


FUZZED = [("chat", "^/v1/chat/"), ("other", "^/v1/(?!chat/)")]


def _fuzz(url: str, path_regex: str, report_dir: Path) -> subprocess.Popen:
    report_dir.mkdir()
    cmd = [
        ST, "run", f"{url}/openapi.json",
        "--include-path-regex", path_regex,
        "--checks", "not_a_server_error",
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", str(EXAMPLES),
        "--seed", "0",
        "--workers", "1",
        "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--generation-database", "none",
        "--no-color",
        "--report", "junit", "--report-dir", str(report_dir),
    ]
    # cwd: Schemathesis keeps a cache folder where it runs.
    with open(report_dir / "out.txt", "w") as out:  # files, not pipes: neither waits on a full pipe
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=report_dir)


def test_fuzzing_the_openapi_schema_finds_no_server_error(duet, tmp_path):
    schema = httpx.get(f"{duet.url}/openapi.json", timeout=30).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}

    # Each generation endpoint in a fuzzer process of its own, with one thread each: two
    # or more threads in one process hit a CPython 3.11 AST race inside Hypothesis while it
    # builds strategies for the nested request schemas (SystemError: AST constructor
    # recursion depth mismatch), a failure of the fuzzer, not of the server.
    runs = {name: _fuzz(duet.url, regex, tmp_path / name) for name, regex in FUZZED}
    for name, run in runs.items():
        run.wait(timeout=1200)
        out = (tmp_path / name / "out.txt").read_text()[-6000:]
        print(out)
        assert run.returncode == 0, out

    r = httpx.post(f"{duet.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": FUZZ_MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == FUZZ_MAX_TOKENS
    for pool in duet.pool_names():
        wait_baseline(duet, pool)
