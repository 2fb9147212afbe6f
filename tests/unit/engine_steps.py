"""Driving an in-process `Engine` step by step, for the unit tests that follow one request."""

from __future__ import annotations

from engine.engine import Engine
from engine.request import RequestOutput


def run(engine: Engine, request_id: str, n_steps: int | None = None) -> list[RequestOutput]:
    """Step until `request_id` finished (or `n_steps` steps); its outputs."""
    outs: list[RequestOutput] = []
    steps = 0
    while engine.has_unfinished() and (n_steps is None or steps < n_steps):
        outs += [o for o in engine.step() if o.request_id == request_id]
        steps += 1
        if outs and outs[-1].finished:
            break
    return outs
