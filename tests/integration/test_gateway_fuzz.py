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
from duet_cluster import wait_baseline

pytestmark = [pytest.mark.integration, pytest.mark.cluster("chaos")]

ST = str(Path(sys.executable).with_name("st"))
EXAMPLES = 30  # per endpoint and phase
REQUEST_TIMEOUT_S = 60


def test_fuzzing_the_openapi_schema_finds_no_server_error(duet, tmp_path):
    schema = httpx.get(f"{duet.url}/openapi.json", timeout=30).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}

    cmd = [
        ST, "run", f"{duet.url}/openapi.json",
        "--include-path-regex", "^/v1/",
        "--checks", "not_a_server_error",
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", str(EXAMPLES),
        "--seed", "0",
        "--workers", "2",  # more threads hit a CPython 3.11 AST race inside Hypothesis (SystemError)
        "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--generation-database", "none",
        "--no-color",
        "--report", "junit", "--report-dir", str(tmp_path),
    ]
    # cwd: Schemathesis keeps a cache folder where it runs.
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    print(run.stdout[-6000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]

    r = httpx.post(f"{duet.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    for pool in duet.pool_names():
        wait_baseline(duet, pool)
