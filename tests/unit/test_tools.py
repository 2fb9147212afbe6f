"""Tool calls (routing/openai/tools.py): which tools a reply may call, how they reach
the prompt, the grammar that makes "required" and named choices well-formed calls,
and how a reply becomes `tool_calls`, whole and streamed (the `openai` client's own
types parse what the gateway sends)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.sampling_params import SamplingParams
from routing.openai.errors import APIError
from routing.openai.protocol import ChatCompletionRequest, parse_request
from routing.openai.stream import ChatStream, build_chat_response
from routing.openai.tools import ToolUse

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
MSGS = [{"role": "user", "content": "What's the weather in Paris?"}]


def chat(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"messages": MSGS, "max_tokens": 64, **body}))


def api_error(fn) -> APIError:
    with pytest.raises(APIError) as e:
        fn()
    return e.value


class Out:  # shaped like engine.request.RequestOutput
    def __init__(self, text: str, finish_reason: str | None = None):
        self.text, self.new_token_ids, self.finish_reason = text, [1], finish_reason
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens, self.logprobs = 9, 0, 0, None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_tools_that_do_not_fit_are_a_400(body, param):
    err = api_error(lambda: chat(**body).to_sampling_params(num_prompt_tokens=9, max_model_len=512))
    assert err.status == 400 and (err.param or "").startswith(param), (err.param, err.message)


def test_no_callable_tool_means_no_tool_use():
    assert chat().tool_use() is None and chat(tools=[WEATHER], tool_choice="none").tool_use() is None
    assert chat(tools=[], tool_choice="auto").tool_use() is None
    plain = chat(tools=[WEATHER], tool_choice="none").template_messages()
    assert plain == [{"role": "user", "content": MSGS[0]["content"]}]


def test_tools_reach_the_prompt_and_earlier_calls_stay_in_it():
    history = [{"role": "system", "content": "Be brief."}, *MSGS,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    msgs = chat(messages=history, tools=[WEATHER, TIME]).template_messages()
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\nYou can call these")
    assert '"name": "get_weather"' in msgs[0]["content"] and '"name": "get_time"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'}
    assert msgs[3] == {"role": "tool", "content": "18 C, sunny"}
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    system = named.template_messages()[0]["content"]
    assert "get_time" in system and "get_weather" not in system and "must call" in system


def test_required_and_named_choices_are_grammars_auto_is_not():
    assert chat(tools=[WEATHER]).to_sampling_params().structured is None  # auto
    required = chat(tools=[WEATHER, TIME], tool_choice="required").to_sampling_params().structured
    assert required.param == "tools"
    assert [c["properties"]["name"] for c in json.loads(required.spec)["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.to_sampling_params().structured.spec)["properties"]["arguments"] == \
        WEATHER["function"]["parameters"]


def test_a_reply_is_a_call_only_when_it_is_exactly_one_call():
    use = ToolUse.of(chat(tools=[WEATHER]).tools, "auto")
    call = use.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")
    for text in ('{"name": "get_time", "arguments": {}}', '{"name": "get_weather"}', "It is sunny.",
                 '{"name": "get_weather", "arguments": {}, "x": 1}', '{"name": "get_weather", "arguments": 3}'):
        assert use.parse(text) is None, text


def test_whole_response_with_a_call_and_with_text():
    use = ToolUse.of(chat(tools=[WEATHER]).tools, "auto")
    outs = [Out('{"name": "get_weather", '), Out('"arguments": {"city": "Rome"}}', "stop")]
    resp = build_chat_response("c", "m", outs, tools=use)
    parsed = ChatCompletion.model_validate(resp.model_dump(exclude_none=True))
    assert parsed.choices[0].finish_reason == "tool_calls" and parsed.choices[0].message.content is None
    assert parsed.choices[0].message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    text = build_chat_response("c", "m", [Out("Sunny.", "stop")], tools=use)
    assert text.choices[0].message.content == "Sunny." and text.choices[0].finish_reason == "stop"


def _chunks(stream: ChatStream, outs: list[Out]) -> list[str]:
    return [stream.chunk([o]) for o in outs]


def test_a_required_call_streams_as_openai_streams_one():
    """The head (id, name) once the name is known, then argument fragments; the
    fragments add up to the arguments, and the call's own closing brace is not one."""
    use = ToolUse.of(chat(tools=[WEATHER]).tools, "required")
    pieces = ["{", '"name": "get_', 'weather", "arguments": {"ci', 'ty": "Ro', 'me"}', "}"]
    outs = [Out(p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    events = [e for e in _chunks(ChatStream("c", "m", tools=use), outs) if e]
    chunks = [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert all(t.id is None and t.function.name is None for t in calls[1:])
    assert "".join(t.function.arguments for t in calls) == '{"city": "Rome"}'
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_a_required_call_cut_by_max_tokens_ends_with_length():
    use = ToolUse.of(chat(tools=[WEATHER]).tools, "required")
    stream = ChatStream("c", "m", tools=use)
    events = [stream.chunk([Out('{"name": "get_weather", "arguments": {"city": "Ro')]),
              stream.chunk([Out('me"}', "length")])]
    last = ChatCompletionChunk.model_validate(json.loads(events[-1].removeprefix("data: ")))
    assert last.choices[0].finish_reason == "length"
    assert last.choices[0].delta.tool_calls[0].function.arguments == 'me"}'  # all sent: it is not the call's end


def test_streamed_text_under_auto_is_not_held():
    use = ToolUse.of(chat(tools=[WEATHER]).tools, "auto")
    events = _chunks(ChatStream("c", "m", tools=use), [Out(" "), Out("It is"), Out(" sunny.", "stop")])
    assert events[0] == ""
    texts = [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))).choices[0].delta.content
             for e in events[1:]]
    assert texts == [" It is", " sunny."]


def test_the_engine_makes_a_well_formed_call_when_required(engine):
    req = chat(tools=[WEATHER, TIME], tool_choice="required")
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(req.template_messages()))
    sp: SamplingParams = req.to_sampling_params(len(prompt), engine.cfg.max_model_len, None,
                                                engine.model_config.vocab_size)
    sp.temperature = 0
    out = engine.generate([prompt], sp)[0]
    call = req.tool_use().parse(out.text)
    assert call is not None, out.text
    if call.function.name == "get_weather":
        assert isinstance(json.loads(call.function.arguments)["city"], str)
