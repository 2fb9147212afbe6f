"""Reading an OpenAI-style SSE stream in tests (`from sse import data_events`: pytest
puts tests/ on sys.path through conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator


def data_events(response) -> Iterator[dict]:
    """Each `data:` event of a streamed response, parsed, up to `[DONE]`; an event
    carrying `error` fails the test."""
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        assert "error" not in event, event
        yield event
