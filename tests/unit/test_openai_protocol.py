"""OpenAI protocol layer: request validation, error bodies, SamplingParams mapping, SSE
framing checked against the official `openai` client's types. No Ray, no model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from engine.structured import StructuredOutput
from routing.openai.errors import (
    APIError,
    context_length_exceeded,
    from_validation_error,
    install_error_handlers,
    internal_error,
    model_not_found,
    not_ready,
    overloaded,
)
from routing.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from routing.openai.stream import (
    SSE_DONE,
    ChatStream,
    CompletionStream,
    build_chat_response,
    build_completion_response,
    sse_error,
)

pytestmark = pytest.mark.unit

MSGS = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class LP:  # shaped like engine.request.TokenLogprob
    token_id: int
    logprob: float
    top: tuple = ()


@dataclass
class Out:  # shaped like engine.request.RequestOutput
    text: str
    new_token_ids: list
    finish_reason: str | None = None
    finished: bool = False
    num_prompt_tokens: int = 7
    num_cached_tokens: int = 4
    num_output_tokens: int = 0
    logprobs: list | None = None


VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}


def tok(i: int) -> str:
    return VOCAB[i]


def deltas(logprobs: bool = False) -> list[Out]:
    out, n = [], 0
    for i, finish in ((1, None), (2, None), (3, None), (4, None), (5, "stop")):
        n += 1
        lps = [LP(i, -0.5 * i, ((i, -0.5 * i), (5, -3.0)))] if logprobs else None
        out.append(Out(VOCAB[i], [i], finish, finish is not None, num_output_tokens=n, logprobs=lps))
    return out


def sse_payloads(text: str) -> list:
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def api_error(fn) -> APIError:
    with pytest.raises(APIError) as ei:
        fn()
    return ei.value


def chat_error(body: dict) -> APIError:
    with pytest.raises(ValidationError) as ei:
        ChatCompletionRequest.model_validate(body)
    return from_validation_error(ei.value)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": MSGS, "max_tokens": -1}, "max_tokens"),
        ({"messages": MSGS, "max_tokens": "many"}, "max_tokens"),
        ({"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": MSGS, "top_p": 1.5}, "top_p"),
        ({"messages": MSGS, "temperature": -0.1}, "temperature"),
        ({"messages": MSGS, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": MSGS, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": MSGS, "stop": 5}, "stop"),
        ({"messages": MSGS, "n": 0}, "n"),
        ({"messages": MSGS, "logit_bias": {"five": 10}}, "logit_bias"),
    ],
)
def test_chat_validation_names_param(body, param):
    err = chat_error(body)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param, err.message
    assert param in err.message


def test_missing_messages_and_n_messages():
    assert chat_error({"model": "m"}).message == "Missing required parameter: 'messages'."
    assert "less than or equal to 128" in chat_error({"messages": MSGS, "n": 129}).message


def test_unknown_fields_ignored_and_content_parts_joined():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "parallel_tool_calls": False,
            "metadata": {"x": 1},
            "n": 1,
        }
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "prompt, expected",
    [("hello", "hello"), ([1, 2, 3], [1, 2, 3]), (["one"], "one"), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == expected


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
        ({"prompt": [[1], [2]]}, "prompt", "batched prompts"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, -2]}, "prompt", "non-negative"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "best_of": 0}, "best_of", ""),
        ({"prompt": "x", "logprobs": 21}, "logprobs", ""),
        ({}, "prompt", "Missing"),
    ],
)
def test_completion_validation(extra, param, words):
    with pytest.raises(ValidationError) as ei:
        CompletionRequest.model_validate({"model": "m", **extra})
    err = from_validation_error(ei.value)
    assert (err.status, err.param) == (400, param)
    assert words in err.message


def test_parse_request_raw_bodies():
    assert parse_request(ChatCompletionRequest, json.dumps({"messages": MSGS})).messages[0].text == "hi"
    for raw in (b"{not json", b"", b"[1, 2]", b"\xff\xfe"):
        err = api_error(lambda raw=raw: parse_request(ChatCompletionRequest, raw))
        assert err.status == 400 and err.param is None
    assert api_error(lambda: parse_request(ChatCompletionRequest, b'{"messages": 1}')).param == "messages"


# ---------------------------------------------------------------- errors


def test_error_body_shape_and_statuses():
    cases = [
        (model_not_found("nope"), 404, "invalid_request_error", "model_not_found"),
        (context_length_exceeded(100, 50, 128), 400, "invalid_request_error", "context_length_exceeded"),
        (overloaded(), 429, "rate_limit_error", "rate_limit_exceeded"),
        (not_ready(), 503, "server_error", "service_unavailable"),
        (internal_error(), 500, "server_error", "internal_error"),
    ]
    for err, status, typ, code in cases:
        body = err.body()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert (err.status, body["error"]["type"], body["error"]["code"]) == (status, typ, code)
    assert model_not_found("nope").param == "model"
    assert "Retry-After" in overloaded().headers and "Retry-After" in not_ready().headers
    msg = context_length_exceeded(100, 50, 128).message
    assert "128" in msg and "150" in msg


# ---------------------------------------------------------------- sampling params


def test_chat_sampling_params_mapping():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": MSGS,
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 5,
            "stop": "END",
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
        }
    )
    sp = req.to_sampling_params()
    assert sp.max_tokens == 20  # max_completion_tokens wins
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed) == (0, 0.9, 5, 7)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)
    assert sp.stop == ["END"] and sp.logprobs == 3 and sp.ignore_eos and sp.greedy


def test_chat_defaults_and_context():
    req = ChatCompletionRequest.model_validate({"messages": MSGS})
    sp = req.to_sampling_params(num_prompt_tokens=30, max_model_len=128)
    assert sp.max_tokens == 98 and sp.temperature == 1.0 and sp.top_p == 1.0 and sp.logprobs is None
    with pytest.raises(ValueError):
        req.to_sampling_params()  # no max_tokens and no context to fill
    err = api_error(lambda: req.to_sampling_params(num_prompt_tokens=128, max_model_len=128))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    long = ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 100})
    err = api_error(lambda: long.to_sampling_params(num_prompt_tokens=30, max_model_len=128))
    assert err.code == "context_length_exceeded"
    lp0 = ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 4, "logprobs": True})
    assert lp0.to_sampling_params().logprobs == 0
    bad = ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 4, "top_logprobs": 2})
    assert api_error(bad.to_sampling_params).param == "top_logprobs"


def test_the_servers_max_tokens_limit():
    # Unset: the rest of the context, at most the limit; above the limit: a 400 naming the field.
    chat = ChatCompletionRequest.model_validate({"messages": MSGS})
    assert chat.to_sampling_params(num_prompt_tokens=30, max_model_len=128, limit=8).max_tokens == 8
    assert chat.to_sampling_params(num_prompt_tokens=124, max_model_len=128, limit=8).max_tokens == 4
    over = ChatCompletionRequest.model_validate({"messages": MSGS, "max_completion_tokens": 9})
    err = api_error(lambda: over.to_sampling_params(num_prompt_tokens=30, max_model_len=128, limit=8))
    assert (err.status, err.param) == (400, "max_completion_tokens") and "limit of 8" in err.message
    assert CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(limit=8).max_tokens == 8
    err = api_error(lambda: CompletionRequest.model_validate({"prompt": "x", "max_tokens": 9}).to_sampling_params(
        num_prompt_tokens=1, max_model_len=128, limit=8))
    assert err.param == "max_tokens"


def test_best_of_candidates_carry_logprobs_and_are_never_streamed_or_fewer_than_n():
    def req(**fields):
        return CompletionRequest.model_validate({"prompt": "x", **fields})

    assert (req().candidates, req(n=2).candidates, req(n=2, best_of=5).candidates) == (1, 2, 5)
    assert req(best_of=3).to_sampling_params().logprobs == 0  # ranked by each token's logprob
    assert req(best_of=3, logprobs=2).to_sampling_params().logprobs == 2
    assert req(n=2, best_of=2, stream=True).to_sampling_params().logprobs is None  # no ranking: streams as n
    err = api_error(req(n=3, best_of=2).to_sampling_params)
    assert (err.status, err.param) == (400, "best_of") and "at least n" in err.message
    err = api_error(req(best_of=2, stream=True).to_sampling_params)
    assert (err.status, err.param) == (400, "best_of") and "streamed" in err.message


def test_completion_sampling_params_and_engine_errors():
    req = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2, "stop": ["a", "b"]})
    sp = req.to_sampling_params()
    assert sp.max_tokens == 16 and sp.logprobs == 2 and sp.stop == ["a", "b"]
    err = api_error(lambda: req.to_sampling_params(num_prompt_tokens=120, max_model_len=128))
    assert (err.code, err.param) == ("context_length_exceeded", "prompt")
    # An engine-side InvalidRequest comes back as a 400 naming the field.
    empty_stop = CompletionRequest.model_validate({"prompt": "x", "stop": [""]})
    err = api_error(empty_stop.to_sampling_params)
    assert (err.status, err.param) == (400, "stop")


# ---------------------------------------------------------------- streaming


def test_chat_stream_parses_with_openai_types_and_batches():
    outs = deltas(logprobs=True)
    stream = ChatStream("chatcmpl-1", "m", include_usage=True, logprobs=True, token_text=tok)
    events = stream.chunk(outs[:1]) + stream.chunk(outs[1:4]) + stream.chunk(outs[4:]) + stream.done()
    payloads = sse_payloads(events)
    assert payloads[-1] == "[DONE]" and events.endswith(SSE_DONE)
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    assert len(chunks) == 4  # three batches + usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:3])
    assert "role" not in json.loads(payloads[1])["choices"][0]["delta"]
    assert "".join(c.choices[0].delta.content for c in chunks[:3]) == "Hello world!"
    assert chunks[1].choices[0].delta.content == "lo world"
    assert [c.choices[0].finish_reason for c in chunks[:3]] == [None, None, "stop"]
    merged = chunks[1].choices[0].logprobs.content
    assert [t.token for t in merged] == ["lo", " wor", "ld"]
    assert merged[0].logprob == -1.0 and merged[0].bytes == list(b"lo")
    assert [t.token for t in merged[0].top_logprobs] == ["lo", "!"]
    assert all(c.usage is None for c in chunks[:3])
    usage = chunks[3]
    assert usage.choices == [] and usage.id == "chatcmpl-1"
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (7, 5, 12)
    assert usage.usage.prompt_tokens_details.cached_tokens == 4
    assert len({c.created for c in chunks}) == 1


def test_chat_stream_without_usage_or_logprobs():
    stream = ChatStream("chatcmpl-2", "m")
    outs = deltas(logprobs=True)
    text = stream.chunk(outs) + stream.chunk([Out("", [], num_output_tokens=5)]) + stream.done()
    payloads = sse_payloads(text)
    assert len(payloads) == 2 and payloads[1] == "[DONE]"  # empty batch sends nothing
    raw = json.loads(payloads[0])
    assert "usage" not in raw and raw["choices"][0]["logprobs"] is None
    ChatCompletionChunk.model_validate(raw)


def test_chat_stream_first_token_alone_and_prefill_done():
    stream = ChatStream("c", "m")
    first = Out("Hel", [1], "prefill_done", True, num_output_tokens=1)
    chunk = ChatCompletionChunk.model_validate(json.loads(sse_payloads(stream.chunk([first]))[0]))
    assert chunk.choices[0].delta.role == "assistant" and chunk.choices[0].finish_reason is None


def test_completion_stream_parses_with_openai_types():
    outs = deltas(logprobs=True)
    stream = CompletionStream("cmpl-1", "m", include_usage=True, logprobs=True, token_text=tok)
    text = stream.chunk(outs[:2]) + stream.chunk(outs[2:]) + stream.done()
    payloads = sse_payloads(text)
    assert payloads[-1] == "[DONE]"
    raws = [json.loads(p) for p in payloads[:-1]]
    # OpenAI streams `finish_reason: null` mid-stream although `Completion` types it as
    # required; the client builds stream items with construct_type, so do the same there.
    assert raws[0]["choices"][0]["finish_reason"] is None
    chunks = [construct_type(type_=Completion, value=raws[0])] + [Completion.model_validate(r) for r in raws[1:]]
    assert [c.choices[0].text for c in chunks[:2]] == ["Hello", " world!"]
    lp = chunks[1].choices[0].logprobs
    assert lp.tokens == [" wor", "ld", "!"]
    assert lp.text_offset == [5, 9, 11]
    assert lp.token_logprobs == [-1.5, -2.0, -2.5]
    assert lp.top_logprobs[0] == {" wor": -1.5, "!": -3.0}
    assert chunks[1].choices[0].finish_reason == "stop"
    assert chunks[2].choices == [] and chunks[2].usage.total_tokens == 12


def test_non_streaming_responses_parse_with_openai_types():
    chat = build_chat_response("chatcmpl-3", "m", deltas(True), logprobs=True, token_text=tok)
    parsed = ChatCompletion.model_validate(json.loads(chat.model_dump_json()))
    assert parsed.choices[0].message.content == "Hello world!"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].finish_reason == "stop"
    assert len(parsed.choices[0].logprobs.content) == 5
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4 and parsed.usage.completion_tokens == 5

    comp = build_completion_response("cmpl-3", "m", deltas(), logprobs=False)
    parsed = Completion.model_validate(json.loads(comp.model_dump_json()))
    assert parsed.choices[0].text == "Hello world!" and parsed.choices[0].logprobs is None
    assert parsed.usage.total_tokens == 12


def test_length_finish_and_sse_error():
    outs = [Out("a", [1], "length", True, num_output_tokens=1)]
    resp = build_chat_response("c", "m", outs)
    assert resp.choices[0].finish_reason == "length"
    payload = json.loads(sse_payloads(sse_error(internal_error("decode replica died")))[0])
    assert payload["error"]["message"] == "decode replica died"


def test_model_list():
    ml = ModelList(data=[ModelCard(id="tinyllama", max_model_len=2048)])
    raw = json.loads(ml.model_dump_json())
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    from openai.types import Model

    Model.model_validate(raw["data"][0])


# ---------------------------------------------------------------- FastAPI handlers


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        if req.model == "missing":
            raise model_not_found(req.model)
        if req.model == "busy":
            raise overloaded()
        if req.model == "boom":
            raise RuntimeError("bug")
        return {"ok": True}

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    "content, status, param",
    [
        (b"{bad json", 400, None),
        (b"", 400, None),
        (b'["a"]', 400, None),
        (json.dumps({"model": "m"}).encode(), 400, "messages"),
        (json.dumps({"messages": MSGS, "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": MSGS, "model": "missing"}).encode(), 404, "model"),
        (json.dumps({"messages": MSGS, "model": "busy"}).encode(), 429, None),
        (json.dumps({"messages": MSGS, "model": "boom"}).encode(), 500, None),
    ],
)
def test_http_errors_are_openai_format(client, content, status, param):
    r = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_http_ok_and_unknown_route(client):
    assert client.post("/v1/chat/completions", json={"messages": MSGS}).json() == {"ok": True}
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# ---------------------------------------------------------------- the official client


def _openai_client(handler):
    import httpx
    import openai

    http = httpx.Client(transport=httpx.MockTransport(handler))
    return openai.OpenAI(base_url="http://duet/v1", api_key="x", http_client=http, max_retries=0)


def test_openai_client_reads_stream_errors_and_usage():
    import httpx
    import openai

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("max_tokens") == -1:
            return httpx.Response(400, json=chat_error(body).body())
        stream = ChatStream("chatcmpl-9", "m", include_usage=body["stream_options"]["include_usage"])
        outs = deltas()
        text = stream.chunk(outs[:1]) + stream.chunk(outs[1:])
        text += sse_error(internal_error("decode replica died")) if body.get("seed") == 13 else stream.done()
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    client = _openai_client(handler)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MSGS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "Hello world!"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 4

    with pytest.raises(openai.APIError, match="decode replica died"):
        opts = {"include_usage": False}
        list(client.chat.completions.create(model="m", messages=MSGS, stream=True, seed=13, stream_options=opts))

    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=-1)
    assert ei.value.param == "max_tokens" and ei.value.status_code == 400


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 9223372036854775808),
        ("seed", 2**64),
        ("max_tokens", 2**40),
        ("stop_token_ids", [2**40]),
    ],
)
def test_integers_out_of_range_are_a_400_naming_the_field(field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    err = api_error(lambda: parse_request(ChatCompletionRequest, json.dumps(body)))
    assert err.status == 400 and field in (err.param or "") + err.message


def test_non_finite_floats_are_a_400():
    body = '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    err = api_error(lambda: parse_request(ChatCompletionRequest, body))
    assert err.status == 400 and "temperature" in (err.param or "") + err.message


def test_absurd_nesting_is_a_400():
    body = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    err = api_error(lambda: parse_request(CompletionRequest, body))
    assert err.status == 400


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("guided_grammar", "root ::= x"),
    ("structured_outputs", {"json": {}}),
])
def test_grammars_and_functions_are_refused_not_ignored(field, value):
    err = chat_error({"messages": MSGS, field: value})
    assert err.status == 400 and err.param == field and "not supported" in err.message


def test_values_that_ask_for_nothing_are_accepted():
    req = parse_request(ChatCompletionRequest, json.dumps({
        "messages": MSGS, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
        "parallel_tool_calls": True, "user": "u", "metadata": {"k": "v"},
    }))
    assert req.messages[0].text == "hi"
    assert req.to_sampling_params(vocab_size=100, num_prompt_tokens=1, max_model_len=8).structured is None


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("cls, field, value, want", [
    (ChatCompletionRequest, "response_format", {"type": "json_object"}, StructuredOutput("json_object")),
    (ChatCompletionRequest, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    (ChatCompletionRequest, "guided_json", SCHEMA, StructuredOutput("json_schema", json.dumps(SCHEMA), "guided_json")),
    (CompletionRequest, "guided_regex", "[a-z]+", StructuredOutput("regex", "[a-z]+", "guided_regex")),
    (CompletionRequest, "guided_choice", ["yes", "no"], StructuredOutput("choice", '["yes", "no"]', "guided_choice")),
])
def test_structured_outputs_reach_the_sampling_params(cls, field, value, want):
    body = {"messages": MSGS} if cls is ChatCompletionRequest else {"prompt": "x"}
    req = parse_request(cls, json.dumps({**body, field: value, "max_tokens": 4}))
    assert req.to_sampling_params(vocab_size=100).structured == want


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
])
def test_a_bad_structured_output_is_a_400_naming_its_field(extra, param):
    err = api_error(lambda: parse_request(ChatCompletionRequest, json.dumps({"messages": MSGS, **extra}))
                    .to_sampling_params(vocab_size=100, num_prompt_tokens=1, max_model_len=8))
    assert err.status == 400 and err.param == param, err.message


def test_logit_bias_reaches_the_sampling_params_and_is_checked():
    req = ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 4, "logit_bias": {"5": 10, "7": -100}})
    assert req.to_sampling_params(vocab_size=100).logit_bias == {5: 10.0, 7: -100.0}
    for bad in ({"5": 101}, {"5": "x"}, {"-1": 1}, {"5": float("nan")}, {"²": 1}, {"9" * 30: 1}):
        err = chat_error({"messages": MSGS, "logit_bias": bad})
        assert err.status == 400 and err.param.startswith("logit_bias"), (bad, err.param)
    with pytest.raises(APIError) as e:
        ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 4, "logit_bias": {"100": 1}}) \
            .to_sampling_params(vocab_size=100)
    assert e.value.status == 400 and e.value.param == "logit_bias"


@pytest.mark.parametrize("cls, body, param", [
    (ChatCompletionRequest, '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    (ChatCompletionRequest, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    (CompletionRequest, '{"prompt": "x", "stop": ["ok", "\\udfff"]}', "stop[1]"),
    (CompletionRequest, '{"prompt": "x", "\\ud800": 1}', "\\ud800"),
])
def test_text_that_is_not_unicode_is_a_400_naming_its_field(cls, body, param):
    err = api_error(lambda: parse_request(cls, body))
    assert err.status == 400 and err.param == param
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # the error itself is sendable
    assert parse_request(CompletionRequest, '{"prompt": "a pair is fine \\ud83d\\ude00"}').prompt.endswith("😀")


@pytest.mark.parametrize("sdk_params, model", [
    ("openai.types.chat.completion_create_params", ChatCompletionRequest),
    ("openai.types.completion_create_params", CompletionRequest),
])
def test_every_request_field_of_the_openai_sdk_is_decided(sdk_params, model):
    """Each field the official client can send is a field of ours: honoured, or refused
    with a 400 unless it asks for nothing (UNHONOURED). A field the SDK adds later fails
    here until it is decided; no field is ignored."""
    import importlib

    sdk = importlib.import_module(sdk_params).CompletionCreateParamsBase
    undecided = set(sdk.__annotations__) - set(model.model_fields)
    assert not undecided, f"decide these {model.__name__} fields: {sorted(undecided)}"


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"), ("verbosity", "low"),
    ("web_search_options", {}), ("moderation", {"model": "m"}), ("store", True), ("service_tier", "flex"),
    ("prompt_cache_retention", "24h"), ("prompt_cache_options", {"ttl": "1h"}), ("best_of", 2),
])
def test_platform_features_are_refused_unless_they_ask_for_nothing(field, value):
    err = chat_error({"messages": MSGS, field: value})
    assert err.status == 400 and err.param == field
    harmless = {"modalities": ["text"], "store": False, "service_tier": "auto", "prompt_cache_retention": "in_memory",
                "best_of": 1}
    if field in harmless:
        parse_request(ChatCompletionRequest, json.dumps({"messages": MSGS, field: harmless[field]}))


def _wire_names(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("ours, sdk", [
    ("ChatMessage", ["chat.ChatCompletionSystemMessageParam", "chat.ChatCompletionUserMessageParam",
                     "chat.ChatCompletionAssistantMessageParam", "chat.ChatCompletionToolMessageParam",
                     "chat.ChatCompletionDeveloperMessageParam"]),
    ("TextContentPart", ["chat.ChatCompletionContentPartTextParam"]),
    ("StreamOptions", ["chat.ChatCompletionStreamOptionsParam"]),
    ("ResponseFormat", ["shared_params.ResponseFormatText", "shared_params.ResponseFormatJSONObject",
                        "shared_params.ResponseFormatJSONSchema"]),
    ("JsonSchemaFormat", ["shared_params.response_format_json_schema.JSONSchema"]),
    ("Tool", ["chat.ChatCompletionFunctionToolParam"]),
    ("FunctionDefinition", ["shared_params.FunctionDefinition"]),
    ("ToolCall", ["chat.ChatCompletionMessageFunctionToolCallParam"]),
    ("FunctionCall", ["chat.chat_completion_message_function_tool_call_param.Function"]),
    ("NamedToolChoice", ["chat.ChatCompletionNamedToolChoiceParam"]),
    ("FunctionName", ["chat.chat_completion_named_tool_choice_param.Function"]),
])
def test_every_nested_field_of_the_openai_sdk_is_decided(ours, sdk):
    """As the top level: each field the SDK's nested types define is a field of ours
    (honoured, accepted as a null echo, or refused), so none is dropped; a field the SDK
    adds later fails here until it is decided."""
    import importlib

    from routing.openai import protocol, tools

    model = getattr(protocol, ours, None) or getattr(tools, ours)
    assert model.model_config.get("extra") == "forbid"
    defined: set[str] = set()
    for name in sdk:
        module, _, type_name = f"openai.types.{name}".rpartition(".")
        defined |= set(getattr(importlib.import_module(module), type_name).__annotations__)
    undecided = defined - _wire_names(model)
    assert not undecided, f"decide these {ours} fields: {sorted(undecided)}"


@pytest.mark.parametrize("body, param", [
    ({"messages": [MSGS[0], {"role": "user", "content": "x", "bogus": 1}]}, "messages[1].bogus"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "colour": "red"}]}]},
     "messages[0].content[0].colour"),
    ({"messages": MSGS, "stream": True, "stream_options": {"include_usage": True, "every": 2}}, "stream_options.every"),
    ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {},
                                                                                   "mode": "x"}}},
     "response_format.json_schema.mode"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
     "tools[0].function.examples"),
    ({"messages": MSGS, "tool_choice": {"type": "function", "function": {"name": "f"}, "why": 1}}, "tool_choice.why"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", "x": 1}}]}]},
     "messages[0].tool_calls[0].function.x"),
    ({"messages": MSGS, "bogus": 1}, "bogus"),
    ({"messages": [{"role": "assistant", "content": "no", "refusal": "I will not"}]}, "messages[0].refusal"),
    ({"messages": MSGS, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
])
def test_an_unknown_field_at_any_depth_is_a_400_naming_its_path(body, param):
    err = chat_error(body)
    assert err.status == 400 and err.param == param, err.body()


def test_an_assistant_response_sent_back_with_its_null_echoes_is_accepted():
    echo = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": None}
    req = parse_request(ChatCompletionRequest, json.dumps({"messages": [*MSGS, echo, *MSGS]}))
    assert [m["content"] for m in req.template_messages()] == ["hi", "Paris.", "hi"]


def test_a_json_object_format_with_a_schema_is_that_schema():
    """instructor's JSON_SCHEMA mode: `{"type": "json_object", "schema": S}` is JSON matching S."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse_request(ChatCompletionRequest, json.dumps(
        {"messages": MSGS, "response_format": {"type": "json_object", "schema": schema}}))
    assert req.structured() == StructuredOutput.json_schema(schema, param="response_format.schema")
    plain = parse_request(ChatCompletionRequest, json.dumps({"messages": MSGS,
                                                             "response_format": {"type": "json_object"}}))
    assert plain.structured() == StructuredOutput("json_object")
    misplaced = parse_request(ChatCompletionRequest, json.dumps(
        {"messages": MSGS, "response_format": {"type": "json_schema", "schema": schema}}))
    err = api_error(misplaced.structured)
    assert err.status == 400 and err.param == "response_format.schema"
