"""Test doubles for loadgen (used by its unit tests): a whitespace tokenizer and an
in-process fake OpenAI-compatible streaming server (an httpx transport, no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx


class WordTokenizer:
    """One token per whitespace-separated word; ids are assigned on first sight."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def fake_server(delay_s: float = 0.001, mode: str = "ok") -> httpx.MockTransport:
    """Streams `max_tokens` words. mode: ok | reject (HTTP 429) | cut (no finish,
    no [DONE]) | hang (never ends)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        if mode == "reject":
            return httpx.Response(429, json={"error": {"message": "queue full"}})
        chat = request.url.path.endswith("/chat/completions")
        n = body["max_tokens"]

        async def stream():
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(n):
                await asyncio.sleep(delay_s if mode != "hang" else 10.0)
                last = i == n - 1 and mode != "cut"
                piece = f"w{i} "
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                choice["finish_reason"] = "length" if last else None
                yield _sse({"choices": [choice]})
            if mode == "cut":
                return
            yield _sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return httpx.MockTransport(handler)


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()
