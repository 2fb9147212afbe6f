"""Tool calls in a native format, through the official `openai` client: a cluster whose
chat template renders tools the Hermes way (`gateway.chat_template`,
deploy/chat_templates/hermes_tools.jinja), so the gateway's `tool_format` is hermes.
A required call is one well-formed `<tool_call>` the client gets as `tool_calls`
(whole, streamed, and in each of `n` forked choices), and the follow-up turn with the
call and its `tool` result goes back through the template and is answered."""

from __future__ import annotations

import json

import openai
import pytest
from duet_cluster import wait_baseline, wait_replicas

from engine.weights import SMOLLM2_ID

pytestmark = [pytest.mark.integration, pytest.mark.cluster("auto-resilient")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK = {"model": SMOLLM2_ID, "messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64,
       "temperature": 0}


def client(duet) -> openai.OpenAI:
    return openai.OpenAI(base_url=duet.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_required_call_in_the_native_format_whole_streamed_and_answered(duet):
    wait_replicas("decode", 2)
    r = client(duet).chat.completions.create(**ASK)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)

    chunks = list(client(duet).chat.completions.create(**ASK, stream=True))
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert "".join(t.function.arguments or "" for t in pieces) == call.function.arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    follow = client(duet).chat.completions.create(
        model=SMOLLM2_ID, tools=[WEATHER], max_tokens=16, temperature=0, messages=[
            *CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]).choices[0]
    assert follow.finish_reason in ("stop", "length", "tool_calls")
    assert follow.message.content or follow.message.tool_calls


def test_every_forked_choice_makes_its_own_well_formed_call(duet):
    """n = 3 sampled choices: the grammar holds in each, whether it forked the first
    choice's KV on its decode replica or was computed."""
    wait_replicas("decode", 2)
    r = client(duet).chat.completions.create(**{**ASK, "temperature": 1.0, "seed": 3}, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    wait_baseline(duet, "decode")
