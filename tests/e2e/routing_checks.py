"""The ingress request router's KV-aware choice, checked on a served cluster
(routing/router/ingress.py): which replica served a response, read from its span."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
from serve_process import Served


def replica_of(served: Served, response_id: str, span: str) -> str:
    """The replica that made a response: its `span` (the pool server's, "generate" or
    "decode") in the response's trace says."""
    def made() -> list:
        roots = served.sink.find(**{"duet.request_id": response_id})
        spans = served.sink.trace(roots[0].trace_id) if roots else []
        return [s.attributes["duet.replica"] for s in spans if s.name == span]

    assert served.sink.wait_for(lambda: bool(made()), 60), response_id
    return made()[0]


def assert_prefix_routing(served: Served, span: str) -> None:
    """Two prompts sent together go to different replicas; once their blocks reach the
    router, every prompt that starts with one goes where it is cached, in any order (a
    choice by load alone, least connections or round robin, fails the second)."""
    c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    prefixes = {k: f"Document {k}: " + " ".join(f"{k}{i}" for i in range(80)) for k in ("alpha", "beta")}

    def complete(prompt: str, max_tokens: int) -> str:
        return replica_of(served, c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0).id, span)

    # The router counts its first pick as load until that replica's reports do.
    with ThreadPoolExecutor(2) as pool:
        home = dict(zip(prefixes, pool.map(lambda p: complete(p, 16), prefixes.values())))
    assert home["alpha"] != home["beta"], home

    # Their blocks reach the router in their replicas' reports: wait until a follow-up
    # of each goes home, then every follow-up must.
    deadline = time.monotonic() + 60
    while not all(complete(prefixes[k] + " Question 0?", 1) == home[k] for k in prefixes):
        assert time.monotonic() < deadline, "the router never saw the prefixes' blocks"
    for i, k in enumerate(("alpha", "alpha", "beta", "beta", "alpha", "beta", "beta", "alpha"), 1):
        assert complete(prefixes[k] + f" Question {i}?", 1) == home[k], (i, k, home)
