"""The ingress request router's KV-aware choice, checked on a served cluster
(routing/router/ingress.py): which replica served a response, read from its span."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from serve_process import Served


def routed(served: Served, response_id: str, span: str) -> tuple[str, str | None, float | None]:
    """The replica that made a response, why the ingress request router chose it, and
    its cost there at that moment: its `span` (the pool server's, "generate" or
    "decode") and the request's span (the gateway's, in that replica) in the response's
    trace say."""
    def made() -> list:
        roots = served.sink.find(**{"duet.request_id": response_id})
        spans = served.sink.trace(roots[0].trace_id) if roots else []
        # The request's span ends last (after the response), and may be exported later.
        request = [s.attributes for s in spans if "duet.status" in s.attributes]
        return [(s.attributes["duet.replica"], request[0].get("duet.route.reason"), request[0].get("duet.route.cost"))
                for s in spans if s.name == span and request]

    assert served.sink.wait_for(lambda: bool(made()), 60), response_id
    return made()[0]


def replica_of(served: Served, response_id: str, span: str) -> tuple[str, str | None]:
    """The replica that made a response, and why the ingress request router chose it."""
    replica, why, _ = routed(served, response_id, span)
    return replica, why


def assert_prefix_routing(served: Served, span: str) -> None:
    """Two prompts sent together go to different replicas; once their blocks reach the
    router, every prompt that starts with one goes where it is cached, in any order (a
    choice by load alone, least connections or round robin, fails the second)."""
    c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = c.models.list().data[0].id

    def sent(prompt: str, max_tokens: int) -> tuple[str, str | None, float | None]:
        return routed(served, c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0).id, span)

    def complete(prompt: str, max_tokens: int) -> tuple[str, str | None]:
        replica, why, _ = sent(prompt, max_tokens)
        return replica, why

    # A pair sent together: the router counts its first pick as load until that
    # replica's reports do, so they go to different replicas, chosen by load ("kv":
    # nothing cached yet). Wait for a pair the router chose on an idle view, with fresh
    # prompts each time:
    # - until HAProxy has reloaded with every replica, a pick it cannot pin goes through
    #   Serve's fallback proxy instead, unrouted (no reason on its span);
    # - a replica's report can still count a request of the test before for a moment
    #   after it finished (reports come every `router.stats_period_s`, through Serve's
    #   controller). Then the router sees that replica busy, and the pair's second pick
    #   chooses between two replicas that each count one sequence: its cost is 1 or
    #   more. On an idle view both picks cost less than one sequence; a router that
    #   forgot its first pick would make the second pick cost that little too, on the
    #   first one's replica, and fail below.
    deadline = time.monotonic() + 90
    for attempt in itertools.count():
        prefixes = {k: f"Document {k} {attempt}: " + " ".join(f"{k}{i}" for i in range(80)) for k in ("alpha", "beta")}
        with ThreadPoolExecutor(2) as pool:
            picks = dict(zip(prefixes, pool.map(lambda p: sent(p, 16), prefixes.values())))
        if all(why is not None and cost is not None and cost < 1 for _, why, cost in picks.values()):
            break
        assert time.monotonic() < deadline, picks
    first = {k: (replica, why) for k, (replica, why, _) in picks.items()}
    home = {k: replica for k, (replica, _) in first.items()}
    assert home["alpha"] != home["beta"] and {why for _, why in first.values()} == {"kv"}, picks

    # Their blocks reach the router in their replicas' reports: wait until a follow-up
    # of each goes home, then every follow-up must, chosen for its prefix.
    deadline = time.monotonic() + 60
    while not all(complete(prefixes[k] + " Question 0?", 1) == (home[k], "prefix") for k in prefixes):
        assert time.monotonic() < deadline, "the router never saw the prefixes' blocks"
    for i, k in enumerate(("alpha", "alpha", "beta", "beta", "alpha", "beta", "beta", "alpha"), 1):
        assert complete(prefixes[k] + f" Question {i}?", 1) == (home[k], "prefix"), (i, k, home)
