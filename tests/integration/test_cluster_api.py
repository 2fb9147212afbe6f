"""The OpenAI API of a real duet cluster, through the official `openai` client.

Greedy fp32 output must equal the single-process engine's, in both modes and with
both transfer backends; bad input gets an OpenAI-style 4xx and the server keeps
serving.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from duet_cluster import wait_baseline
from ray import serve

from cluster.serve_config import APP_NAME
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from engine.tokenizer import load_tokenizer
from engine.weights import SMOLLM2_ID
from kvtransfer.messages import PrefillRequest
from routing.openai.metrics import POOL_STATS
from routing.openai.protocol import ChatCompletionRequest

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
PERSON_CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
# A prompt whose continuation recurs in it: n-gram speculation drafts, and is accepted.
REPEATING = "alpha beta gamma delta river mountain " * 6
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}
TOOL_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SETUPS = [
    pytest.param("nixl", marks=pytest.mark.cluster("nixl"), id="disagg-nixl"),
    pytest.param("torch", marks=pytest.mark.cluster("torch"), id="disagg-torch"),
    pytest.param("aggregated", marks=pytest.mark.cluster("aggregated"), id="aggregated"),
]


# Session-scoped: the suite runs tests grouped by cluster config, so a module-scoped
# fixture would be computed again for each config group (~5 CPU s each time).
@pytest.fixture(scope="session")
def reference() -> dict[str, tuple]:
    """(text, completion tokens, finish reason) of the single-process fp32 engine, and
    under "banned" (text, logit_bias) of the completion with its first token banned, and
    under "structured" (text, finish reason) of a JSON-schema chat, under "tool_call" the
    call a required tool choice makes, and under "repeating" (text, tokens) of a
    completion that speculation drafts for."""
    torch.set_num_threads(1)  # the replicas use the other core
    engine = Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024))
    chat_text = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    prompts = {"chat": engine.tokenizer.encode(chat_text), "completion": engine.tokenizer.encode(PROMPT)}
    out = {}
    for kind, ids in prompts.items():
        (res,) = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        out[kind] = (res.text, len(res.token_ids), res.finish_reason)
        if kind == "completion":  # the same prompt with its greedy first token banned
            bias = {res.token_ids[0]: -100.0}
            (banned,) = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias))
            out["banned"] = (banned.text, bias)
    person = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(PERSON_CHAT, add_generation_prompt=True))
    (doc,) = engine.generate([person], SamplingParams(max_tokens=64, temperature=0,
                                                      structured=StructuredOutput.json_schema(PERSON)))
    out["structured"] = (doc.text, doc.finish_reason)
    tool_req = ChatCompletionRequest(messages=TOOL_CHAT, tools=[WEATHER_TOOL], tool_choice="required")
    tool_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(tool_req.template_messages()))
    sp = tool_req.to_sampling_params(len(tool_ids), 1024, 64, engine.model_config.vocab_size)
    sp.temperature = 0
    (call,) = engine.generate([tool_ids], sp)
    out["tool_call"] = json.loads(call.text)
    (rep,) = engine.generate([engine.tokenizer.encode(REPEATING)], SamplingParams(max_tokens=32, temperature=0))
    out["repeating"] = (rep.text, len(rep.token_ids))
    del engine
    torch.set_num_threads(1)
    return out


def client(duet, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=duet.base_url, api_key="unused", max_retries=0, timeout=kw.pop("timeout", 120), **kw)


def run_chat(c: openai.OpenAI, stream: bool):
    if not stream:
        r = c.chat.completions.create(model=SMOLLM2_ID, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for chunk in c.chat.completions.create(
        model=SMOLLM2_ID, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish, usage


def run_completion(c: openai.OpenAI, stream: bool):
    if not stream:
        r = c.completions.create(model=SMOLLM2_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for chunk in c.completions.create(
        model=SMOLLM2_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text or ""
            finish = ch.finish_reason or finish
    return text, finish, usage


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_greedy_output_matches_single_process_engine(duet, reference, setup, kind, stream):
    assert duet.name == setup
    run = run_chat if kind == "chat" else run_completion
    text, finish, usage = run(client(duet), stream)
    ref_text, ref_tokens, ref_finish = reference[kind]
    assert text == ref_text
    assert finish == ref_finish
    assert usage is not None
    assert usage.completion_tokens == ref_tokens
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


# ---------------------------------------------------------------- probes


@pytest.mark.parametrize("setup", SETUPS)
def test_logit_bias_is_honoured_by_prefill_and_decode(duet, reference, setup):
    """The first token (sampled by prefill in P/D) and the rest (decode) both see it."""
    text, bias = reference["banned"]
    r = client(duet).completions.create(model=SMOLLM2_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        logit_bias={str(t): b for t, b in bias.items()})
    assert r.choices[0].text == text
    assert r.choices[0].text != reference["completion"][0]


@pytest.mark.parametrize("setup", SETUPS)
def test_a_json_schema_is_honoured_by_prefill_and_decode(duet, reference, setup):
    """Prefill samples the first token under the grammar, decode resumes it: the streamed
    document is the single-process engine's; a schema that cannot compile is a 400."""
    text, finish = reference["structured"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with pytest.raises(openai.BadRequestError) as bad:
        client(duet).chat.completions.create(model=SMOLLM2_ID, messages=PERSON_CHAT, max_tokens=64, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}})
    assert bad.value.body["param"] == "response_format"
    chunks = client(duet).chat.completions.create(model=SMOLLM2_ID, messages=PERSON_CHAT, max_tokens=64,
                                                  temperature=0, response_format=fmt, stream=True)
    got = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks if c.choices]
    assert "".join(t for t, _ in got) == text and got[-1][1] == finish == "stop"
    assert set(json.loads(text)) == {"name", "age"}
    # `{"type": "json_object", "schema": S}` (instructor's JSON_SCHEMA mode) is the same constraint.
    r = client(duet).chat.completions.create(model=SMOLLM2_ID, messages=PERSON_CHAT, max_tokens=64, temperature=0,
                                             response_format={"type": "json_object", "schema": PERSON})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, "stop")


@pytest.mark.parametrize("setup", SETUPS)
def test_a_required_tool_choice_returns_the_call(duet, reference, setup):
    """Whole and streamed (an id and name first, then argument fragments): the
    single-process engine's call; the turn after the tool's result is answered."""
    want = reference["tool_call"]
    kw = dict(model=SMOLLM2_ID, messages=TOOL_CHAT, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=64,
              temperature=0)
    whole = client(duet).chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == want["name"] and json.loads(call.function.arguments) == want["arguments"]
    chunks = [c for c in client(duet).chat.completions.create(**kw, stream=True) if c.choices]
    pieces = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and pieces[0].id
    arguments = "".join(t.function.arguments or "" for t in pieces)
    assert (pieces[0].function.name, json.loads(arguments)) == (want["name"], want["arguments"])
    # The follow-up turn: the call and its result in the conversation, answered in text.
    follow = client(duet).chat.completions.create(
        model=SMOLLM2_ID, tools=[WEATHER_TOOL], max_tokens=16, temperature=0, messages=[
            *TOOL_CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]).choices[0]
    assert follow.finish_reason in ("stop", "length", "tool_calls")
    assert follow.message.content or follow.message.tool_calls


@pytest.mark.parametrize("setup", SETUPS)
def test_n_choices_whole_and_streamed(duet, reference, setup):
    """Each choice is a sequence of its own: greedy choices equal the single-process
    engine's; usage counts the prompt once and every choice's tokens. The choices after
    the first fork its prompt's KV where it decodes (one prefill, one import), and every
    block is free afterwards."""
    pool = "decode" if duet.cfg.mode == "disaggregated" else "aggregated"
    forks, leases = duet.stats(pool)["num_forks"], _leases_granted(duet)
    ref_text, ref_tokens, _ = reference["completion"]
    r = client(duet).completions.create(model=SMOLLM2_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, ref_text), (1, ref_text)]
    assert r.usage.completion_tokens == 2 * ref_tokens
    one = client(duet).completions.create(model=SMOLLM2_ID, prompt=PROMPT, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    chunks = list(client(duet).chat.completions.create(
        model=SMOLLM2_ID, messages=CHAT, max_tokens=8, temperature=1.0, seed=11, n=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 3 * 8
    # Three choices after a first: each forks unless its first ended before it arrived
    # (then it is computed), which takes that one's last 6-22 tokens in that moment.
    forked = duet.stats(pool)["num_forks"] - forks
    assert 1 <= forked <= 3
    if pool == "decode":  # a choice that forked took no lease: 2 first choices + the unforked
        assert _leases_granted(duet) - leases <= 2 + 3 - forked
    wait_baseline(duet, pool)


def _leases_granted(duet) -> int:
    return duet.stats("prefill")["leases_granted"] if duet.cfg.mode == "disaggregated" else 0


@pytest.mark.parametrize("setup", SETUPS)
def test_best_of_returns_the_candidate_with_the_highest_logprob(duet, setup):
    """`best_of` candidates are the choices the same request gets as `n` (seed + i each);
    the one returned is the one whose tokens' logprobs sum highest, and usage counts
    every candidate's tokens."""
    ask = {"model": SMOLLM2_ID, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 5,
           "extra_body": {"ignore_eos": True}}
    every = client(duet).completions.create(**ask, n=3, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client(duet).completions.create(**ask, best_of=3)
    assert [c.text for c in best.choices] == [every.choices[sums.index(max(sums))].text]
    assert best.choices[0].logprobs is None  # ranked by them, shown only when asked for
    assert (best.usage.prompt_tokens, best.usage.completion_tokens) == (every.usage.prompt_tokens, 3 * 6)


@pytest.mark.parametrize("setup", [p for p in SETUPS if p.values[0] != "nixl"])
def test_speculative_decoding_is_exact_through_the_pool_that_decodes(duet, reference, setup):
    """These clusters decode with speculation (n-gram; "torch" a draft model); its tokens
    are the single-process engine's (which does not speculate), and the decoding
    replica counts its drafts."""
    assert duet.cfg.engine.speculative.method == ("draft" if setup == "torch" else "ngram")
    pool = "decode" if duet.cfg.mode == "disaggregated" else "aggregated"
    before = duet.stats(pool)
    text, tokens = reference["repeating"]
    r = client(duet).completions.create(model=SMOLLM2_ID, prompt=REPEATING, max_tokens=32, temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens) == (text, tokens)
    after = duet.stats(pool)
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert after["spec_verify_steps"] > before["spec_verify_steps"]


@pytest.mark.parametrize("setup", [p for p in SETUPS if p.values[0] in ("torch", "aggregated")])
def test_the_replica_that_decodes_is_the_ingress(duet, setup):
    """No gateway deployment: HTTP reaches the pool that decodes
    (decode in P/D, aggregated otherwise), and it answers for the whole app."""
    pool = "decode" if duet.cfg.mode == "disaggregated" else "aggregated"
    assert set(serve.status().applications[APP_NAME].deployments) == set(duet.cfg.pools())
    with httpx.Client(base_url=duet.url, timeout=30) as h:
        r = h.get("/ready")
        assert r.status_code == 200 and r.json()["mode"] == duet.cfg.mode
    assert duet.stats(pool)["replica_id"].startswith(f"{pool}#")


@pytest.mark.cluster("torch")
def test_a_decode_replica_decodes_for_the_others(duet, reference):
    """Its `generate` (the call a pass migrated off another decode replica, or a
    sequence one hands on as it drains, reaches it by: `pipeline.RemotePool` on the
    deployment's handle) streams greedy tokens equal to the single-process engine's."""
    ids = tuple(load_tokenizer(duet.cfg.engine.model).encode(PROMPT))
    req = PrefillRequest("peer-generate", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    outs = [o for batch in duet.handle("decode").options(stream=True).generate.remote(req) for o in batch]
    assert outs[-1].finished
    assert "".join(o.text for o in outs) == reference["completion"][0]


@pytest.mark.cluster("nixl")
def test_probes_and_models(duet):
    with httpx.Client(base_url=duet.url, timeout=30) as h:
        assert h.get("/health").status_code == 200
        r = h.get("/ready")
        assert r.status_code == 200 and r.json()["status"] == "ready"
        models = client(duet).models.list()
        assert [m.id for m in models.data] == [SMOLLM2_ID]
        metrics = h.get("/metrics")
        assert metrics.status_code == 200
        body = metrics.text
        for pool in ("prefill", "decode"):
            gauged = {line.split('stat="', 1)[1].split('"', 1)[0] for line in body.splitlines()
                      if line.startswith(f'duet_pool_stat{{pool="{pool}"')}
            # Every stat the gauge declares is still reported (a decode pool publishes KV events only
            # where prompts may be prefilled on it).
            assert set(POOL_STATS[pool]) - gauged <= {"kv_events_cached_blocks", "kv_events_seq"}, pool
        assert "duet_ttft_seconds" in body


# ---------------------------------------------------------------- bad input


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err
    if code is not None:
        assert err["code"] == code, err


BAD_REQUESTS = [
    ("/v1/chat/completions", {"model": SMOLLM2_ID}, 400),  # no messages
    ("/v1/chat/completions", {"model": SMOLLM2_ID, "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": SMOLLM2_ID, "messages": CHAT, "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"model": SMOLLM2_ID, "messages": CHAT, "max_tokens": -5}, 400),
    ("/v1/chat/completions", {"model": SMOLLM2_ID, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/completions", {"model": SMOLLM2_ID, "prompt": 42}, 400),
    ("/v1/completions", {"model": SMOLLM2_ID, "prompt": PROMPT, "max_tokens": 0}, 400),
    ("/v1/completions", {"model": SMOLLM2_ID, "prompt": PROMPT, "n": 0}, 400),
    ("/v1/chat/completions", {"model": SMOLLM2_ID, "messages": CHAT, "n": 9}, 400),  # above gateway.max_n
    ("/v1/chat/completions", {"model": "gpt-17", "messages": CHAT}, 404),
]


@pytest.mark.cluster("nixl")
def test_bad_input_gets_openai_errors_and_server_keeps_serving(duet):
    with httpx.Client(base_url=duet.url, timeout=30) as h:
        r = h.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"})
        assert_openai_error(r, 400)
        r = h.post("/v1/completions", content=b"not json at all")
        assert_openai_error(r, 400)
        for path, body, status in BAD_REQUESTS:
            assert_openai_error(h.post(path, json=body), status)
        long_prompt = "hello " * 1100
        r = h.post("/v1/completions", json={"model": SMOLLM2_ID, "prompt": long_prompt, "max_tokens": 4})
        assert_openai_error(r, 400, "context_length_exceeded")
        r = h.post("/v1/chat/completions",
                   json={"model": SMOLLM2_ID, "messages": [{"role": "user", "content": long_prompt}]})
        assert_openai_error(r, 400, "context_length_exceeded")
        r = h.post("/v1/completions", json={"model": SMOLLM2_ID, "prompt": [1, 2, 10**9]})
        assert_openai_error(r, 400)

    c = client(duet)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=SMOLLM2_ID, messages=CHAT, max_tokens=2, n=9)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=SMOLLM2_ID, prompt=PROMPT, max_tokens=-1)
    # A field nobody honours is a 400 naming its path, at any depth.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=SMOLLM2_ID, max_tokens=2, messages=[
            *CHAT, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more", "bogus": 1}])
    assert e.value.body["param"] == f"messages[{len(CHAT) + 1}].bogus"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=SMOLLM2_ID, messages=CHAT, max_tokens=2,
                                  stream_options={"include_usage": True}, extra_body={"stream_options": {
                                      "include_usage": True, "chunk_size": 4}}, stream=True)
    assert e.value.body["param"] == "stream_options.chunk_size"
    # A response sent back as the conversation's next turn (its null echoes included) is fine.
    first = c.chat.completions.create(model=SMOLLM2_ID, messages=CHAT, max_tokens=2, temperature=0)
    again = c.chat.completions.create(model=SMOLLM2_ID, max_tokens=2, temperature=0, messages=[
        *CHAT, first.choices[0].message.model_dump(), {"role": "user", "content": "and?"}])
    assert again.usage.completion_tokens == 2

    # Still serving, and nothing leaked by the rejected requests.
    r = c.completions.create(model=SMOLLM2_ID, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert duet.stats("prefill")["leases_active"] == 0
