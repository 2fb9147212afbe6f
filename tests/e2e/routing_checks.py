"""The ingress request router's KV-aware choice, checked on a served cluster
(routing/router/ingress.py): which replica served a response, read from its span."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from serve_process import Served


def replica_of(served: Served, response_id: str, span: str) -> tuple[str, str | None]:
    """The replica that made a response, and why the ingress request router chose it:
    its `span` (the pool server's, "generate" or "decode") and the request's span (the
    gateway's, in that replica) in the response's trace say."""
    def made() -> list:
        roots = served.sink.find(**{"duet.request_id": response_id})
        spans = served.sink.trace(roots[0].trace_id) if roots else []
        # The request's span ends last (after the response), and may be exported later.
        request = [s for s in spans if "duet.status" in s.attributes]
        why = request[0].attributes.get("duet.route.reason") if request else None
        return [(s.attributes["duet.replica"], why) for s in spans if s.name == span and request]

    assert served.sink.wait_for(lambda: bool(made()), 60), response_id
    return made()[0]


def assert_prefix_routing(served: Served, span: str) -> None:
    """Two prompts sent together go to different replicas; once their blocks reach the
    router, every prompt that starts with one goes where it is cached, in any order (a
    choice by load alone, least connections or round robin, fails the second)."""
    c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = c.models.list().data[0].id

    def complete(prompt: str, max_tokens: int) -> tuple[str, str | None]:
        return replica_of(served, c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0).id, span)

    # A pair sent together: the router counts its first pick as load until that
    # replica's reports do, so they go to different replicas, chosen by load ("kv":
    # nothing cached yet). Until HAProxy has reloaded with every replica, a pick it
    # cannot pin goes through Serve's fallback proxy instead, unrouted (no reason on
    # its span): wait for a pair that got through, with fresh prompts each time.
    deadline = time.monotonic() + 90
    for attempt in itertools.count():
        prefixes = {k: f"Document {k} {attempt}: " + " ".join(f"{k}{i}" for i in range(80)) for k in ("alpha", "beta")}
        with ThreadPoolExecutor(2) as pool:
            first = dict(zip(prefixes, pool.map(lambda p: complete(p, 16), prefixes.values())))
        if all(why is not None for _, why in first.values()):
            break
        assert time.monotonic() < deadline, first
    home = {k: replica for k, (replica, _) in first.items()}
    assert home["alpha"] != home["beta"] and {why for _, why in first.values()} == {"kv"}, first

    # Their blocks reach the router in their replicas' reports: wait until a follow-up
    # of each goes home, then every follow-up must, chosen for its prefix.
    deadline = time.monotonic() + 60
    while not all(complete(prefixes[k] + " Question 0?", 1) == (home[k], "prefix") for k in prefixes):
        assert time.monotonic() < deadline, "the router never saw the prefixes' blocks"
    for i, k in enumerate(("alpha", "alpha", "beta", "beta", "alpha", "beta", "beta", "alpha"), 1):
        assert complete(prefixes[k] + f" Question {i}?", 1) == (home[k], "prefix"), (i, k, home)
