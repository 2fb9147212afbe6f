"""Async streaming client for any OpenAI-compatible server.

Owns the HTTP side of one request: builds the body for `/v1/completions` or
`/v1/chat/completions`, reads the SSE stream, and fills a `RequestResult` with the
time of every non-empty text chunk. It never raises for a server's failure: errors
and timeouts become FAILED or UNFINISHED results so they stay in the denominators.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from loadgen.records import Outcome, RequestResult

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class OpenAIClient:
    """One pooled httpx client against `base_url`; use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        model: str,
        endpoint: str = "completions",
        timeout_s: float = 600.0,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {endpoint!r} not in {tuple(ENDPOINTS)}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No pool limit: an open-loop benchmark must not be throttled by the client.
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            transport=transport,
        )

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def server_info(self) -> dict[str, Any]:
        """GET /v1/models, for the report's server metadata; never raises."""
        try:
            r = await self._http.get("/v1/models", timeout=10.0)
            return {"base_url": self.base_url, "status": r.status_code, "models": r.json()}
        except Exception as e:  # metadata is best effort
            return {"base_url": self.base_url, "error": f"{type(e).__name__}: {e}"}

    def body(self, prompt: str | list[dict[str, str]], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            b["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if ignore_eos:
            b["ignore_eos"] = True  # vLLM/duet extension; forces exactly max_tokens
        b.update(self.extra_body)
        return b

    async def send(
        self,
        prompt: str | list[dict[str, str]],
        result: RequestResult,
    ) -> RequestResult:
        """Send one streaming request and record it into `result` (returned)."""
        body = self.body(prompt, result.max_tokens, result.ignore_eos)
        result.send_time = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(body, result), self.timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            result.outcome = Outcome.UNFINISHED
            result.error = f"timeout after {self.timeout_s:g}s"
        except httpx.HTTPError as e:
            # A stream cut after chunks arrived is unfinished; before, it failed.
            result.outcome = Outcome.UNFINISHED if result.chunk_times else Outcome.FAILED
            result.error = f"{type(e).__name__}: {e}"
        if result.outcome is not Outcome.COMPLETED or result.end_time is None:
            result.end_time = time.perf_counter()
        result.text = "".join(result.chunk_texts)
        return result

    async def _stream(self, body: dict[str, Any], result: RequestResult) -> None:
        async with self._http.stream("POST", ENDPOINTS[self.endpoint], json=body) as resp:
            result.http_status = resp.status_code
            if resp.status_code >= 400:
                raw = (await resp.aread()).decode(errors="replace")
                result.outcome = Outcome.FAILED
                result.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
                return
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                if self._on_event(json.loads(data), result):
                    return
            finished = done or result.finish_reason is not None
            result.outcome = Outcome.COMPLETED if finished else Outcome.UNFINISHED
            if not finished:
                result.error = "stream ended without finish_reason or [DONE]"
            result.end_time = time.perf_counter()

    def _on_event(self, event: dict[str, Any], result: RequestResult) -> bool:
        """Record one SSE event; True if it was an error that ends the request."""
        now = time.perf_counter()
        if "error" in event:
            result.outcome = Outcome.FAILED
            result.error = f"stream error: {_error_message(json.dumps(event))}"
            return True
        if event.get("usage"):
            result.usage = event["usage"]
        for choice in event.get("choices") or []:
            text = choice.get("text") if self.endpoint == "completions" else (choice.get("delta") or {}).get("content")
            # Empty chunks (role-only deltas, usage) are not tokens: not timed, as in vLLM.
            if text:
                result.chunk_times.append(now)
                result.chunk_texts.append(text)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        return False


def _error_message(raw: str) -> str:
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:500]
    except (json.JSONDecodeError, AttributeError):
        return raw[:500]
