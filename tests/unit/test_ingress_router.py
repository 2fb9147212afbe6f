"""The ingress request router reads a body as the gateway will (routing/router/ingress.py):
the same prompt ids, the same KV namespace, and None (routed by load) for anything the
gateway would refuse, so its answer to HAProxy is never an error."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from routing.openai.config import GatewayConfig
from routing.openai.prompts import Prompts
from routing.openai.protocol import ChatCompletionRequest, parse_request
from routing.router.ingress import IngressRouter

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def router() -> SimpleNamespace:
    """What `_read` uses of a router (Serve builds the real one with a pool's handle)."""
    cfg = GatewayConfig()
    return SimpleNamespace(cfg=cfg, prompts=Prompts(EngineConfig(), cfg))


def read(router: SimpleNamespace, body: object) -> tuple[list[int], str | None] | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(IngressRouter._read(router, raw))


def test_a_body_reads_as_the_gateway_renders_it(router: SimpleNamespace):
    tok = router.prompts.tokenizer
    assert read(router, {"prompt": "The capital of France is"}) == (tok.encode("The capital of France is"), None)
    assert read(router, {"prompt": [1, 2, 3], "cache_salt": "tenant"}) == ([1, 2, 3], "salt=tenant")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    expected = asyncio.run(router.prompts.chat_ids(parse_request(ChatCompletionRequest, json.dumps(chat))))
    assert read(router, chat) == (expected, None) and len(expected) > 2


@pytest.mark.parametrize("body", [
    b"{not json", b"[1, 2]", b"\xff\xfe", {"model": "x"},  # unreadable, or neither kind of request
    {"prompt": []}, {"prompt": [10**9]},  # refused by the gateway: empty, out of the vocabulary
    {"prompt": "x", "response_format": {"type": "nope"}},  # an invalid field
    {"messages": "not a list"},
])
def test_a_body_the_gateway_would_refuse_is_routed_by_load(router: SimpleNamespace, body: object):
    assert read(router, body) is None
