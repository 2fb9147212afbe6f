"""Tool calls (routing/openai/tools.py): which tools a reply may call, how they reach
the prompt, the grammar that makes "required" and named choices well-formed calls,
and how a reply becomes `tool_calls`, whole and streamed (the `openai` client's own
types parse what the gateway sends)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.sampling_params import SamplingParams
from routing.openai.errors import APIError
from routing.openai.protocol import ChatCompletionRequest, parse_request
from routing.openai.stream import ChatStream, build_chat_response
from routing.openai.tools import DUET, HERMES, ToolUse, tool_format

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
    (call,) = use.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")
    for text in ('{"name": "get_time", "arguments": {}}', '{"name": "get_weather"}', "It is sunny.",
                 '{"name": "get_weather", "arguments": {}, "x": 1}', '{"name": "get_weather", "arguments": 3}'):
        assert use.parse(text) == [], text


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
    (call,) = req.tool_use().parse(out.text)
    if call.function.name == "get_weather":
        assert isinstance(json.loads(call.function.arguments)["city"], str)


# --------------------------------------------------------------- a native (hermes) format
HERMES_TEMPLATE = (Path(__file__).parents[2] / "deploy" / "chat_templates" / "hermes_tools.jinja").read_text()


def hermes_chat(**body) -> ChatCompletionRequest:
    req = chat(**body)
    req.use_tool_format(HERMES)
    return req


def test_the_format_follows_the_chat_template(engine):
    assert tool_format(engine.tokenizer.chat_template) is DUET  # SmolLM2's knows no tools
    assert tool_format(HERMES_TEMPLATE) is HERMES
    assert tool_format(HERMES_TEMPLATE, "duet") is DUET and tool_format(None, "hermes") is HERMES


def test_a_native_template_renders_the_tools_the_calls_and_the_results(engine):
    history = [{"role": "system", "content": "Be brief."}, *MSGS,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    req = hermes_chat(messages=history, tools=[WEATHER, TIME])
    msgs = req.template_messages()
    assert msgs[0] == {"role": "system", "content": "Be brief."}  # no duet description: the template has them
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert msgs[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert [t["function"]["name"] for t in req.template_tools()] == ["get_weather", "get_time"]
    text = engine.tokenizer.apply_chat_template(msgs, True, req.template_tools(), HERMES_TEMPLATE)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert hermes_chat(tools=[WEATHER], tool_choice="none").template_tools() is None


def test_hermes_replies_are_calls_only_when_they_are_only_calls():
    use = ToolUse.of(chat(tools=[WEATHER, TIME]).tools, "auto", HERMES)
    two = use.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert [(c.function.name, c.function.arguments) for c in two] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    for text in ('{"name": "get_time", "arguments": {}}', "Sunny.", "<tool_call>\n{}\n</tool_call>",
                 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_time", "arguments": {}}'):
        assert use.parse(text) == [], text
    assert use.format.may_start_call(" <tool_") and not use.format.may_start_call("{")


def test_a_required_hermes_call_streams_as_openai_streams_one():
    use = ToolUse.of(chat(tools=[WEATHER]).tools, "required", HERMES)
    pieces = ["<tool_", 'call>\n{"name": "get_weather", "argu', 'ments":', ' {"city": "R', 'ome"}',
              "}\n</tool", "_call>"]
    outs = [Out(p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    events = [e for e in _chunks(ChatStream("c", "m", tools=use), outs) if e]
    chunks = [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather"
    assert "".join(t.function.arguments for t in calls) == '{"city": "Rome"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_several_hermes_calls_under_auto_come_back_with_their_indexes():
    use = ToolUse.of(chat(tools=[WEATHER, TIME]).tools, "auto", HERMES)
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    stream = ChatStream("c", "m", tools=use)
    events = [e for e in (stream.chunk([Out(text[:30])]), stream.chunk([Out(text[30:], "stop")])) if e]
    (chunk,) = [ChatCompletionChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in events]
    assert [(t.index, t.function.name) for t in chunk.choices[0].delta.tool_calls] == [(0, "get_time"),
                                                                                      (1, "get_weather")]
    whole = build_chat_response("c", "m", [Out(text, "stop")], tools=use)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_time", "get_weather"]


def test_the_engine_makes_a_well_formed_hermes_call_when_required(engine):
    """Under the native template, "required" constrains the reply to one call inside
    the format's tags (a Lark grammar around the call's JSON schema)."""
    req = hermes_chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text = engine.tokenizer.apply_chat_template(req.template_messages(), True, req.template_tools(), HERMES_TEMPLATE)
    prompt = engine.tokenizer.encode(text)
    sp: SamplingParams = req.to_sampling_params(len(prompt), engine.cfg.max_model_len, None,
                                                engine.model_config.vocab_size)
    assert sp.structured.kind == "lark"
    sp.temperature = 0
    out = engine.generate([prompt], sp)[0]
    assert out.text.startswith("<tool_call>\n") and out.text.endswith("\n</tool_call>"), out.text
    (call,) = req.tool_use().parse(out.text)
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
