"""A closed-loop driver for one in-process engine (not a target): a fixed number of
requests in flight, each replaced as it finishes; output tok/s, TTFT p50 and each
request's tokens. The engine benchmarks that compare two ways of running the same
work (`duet bench structured`, `duet bench speculative`) drive it."""

from __future__ import annotations

import statistics
import time

from engine.engine import Engine
from engine.sampling_params import SamplingParams


def closed_loop(engine: Engine, work: list[tuple[list[int], SamplingParams]], concurrency: int) -> dict:
    """Run `work` with `concurrency` requests in flight; output tok/s, TTFT p50, and
    each request's output length and tokens (in `work` order)."""
    todo = list(enumerate(work))[::-1]
    started: dict[str, tuple[int, float]] = {}
    first: dict[str, float] = {}
    lengths = [0] * len(work)
    tokens: list[list[int]] = [[] for _ in work]
    ttft = []
    out_tokens = 0
    t0 = time.perf_counter()
    while todo or started:
        while todo and len(started) < concurrency:
            i, (ids, sp) = todo.pop()
            started[engine.add_request(ids, sp)] = (i, time.perf_counter())
        for out in engine.step():
            now = time.perf_counter()
            out_tokens += len(out.new_token_ids)
            tokens[started[out.request_id][0]].extend(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                i, begin = started.pop(out.request_id)
                ttft.append(1000 * (first.pop(out.request_id, now) - begin))
                lengths[i] = out.num_output_tokens
    wall = time.perf_counter() - t0
    return {"output_tok_s": out_tokens / wall, "ttft_p50_ms": statistics.median(ttft), "lengths": lengths,
            "tokens": tokens}
