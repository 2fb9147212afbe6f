"""OpenAI API request and response models (pydantic v2), and the mapping of a request
onto the engine's SamplingParams.

Every object of a request, at every depth (messages and their content parts, tools and
their functions, `response_format`, `stream_options`, `tool_choice`), knows its fields:
a field OpenAI's SDK defines is honoured, or accepted where it is an echo of our own
output that changes nothing (an assistant message's `refusal`, `annotations`, `audio`
and `function_call` when null, as clients send a response back in the conversation);
any other field is a 400 naming its path (`messages[2].bogus`). What duet cannot
honour (batched prompts, `echo`, `suffix`, grammars, the deprecated `functions`:
`UNHONOURED`) is a 400 naming the field, never silently dropped. `best_of` is
honoured on completions (`CompletionRequest.candidates`); on chat, where OpenAI has no
such field, more than one candidate is refused. Structured outputs (`response_format`,
and vLLM's `guided_json`, `guided_regex`, `guided_choice`) are honoured
(engine/structured.py), and so are `tools` and `tool_choice` (routing/openai/tools.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from engine.errors import InvalidRequest
from engine.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN, SamplingParams
from engine.structured import StructuredOutput
from routing.openai.errors import context_length_exceeded, from_validation_error, invalid_request
from routing.openai.tools import (
    DUET,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolFormat,
    ToolUse,
    parse_arguments,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Fields that change what a client gets back and that duet cannot honour yet, with the
# values that ask for nothing (accepted, since clients send them by default).
UNHONOURED_SAMPLING = ("guided_grammar", "structured_outputs", "logits_processors")
UNHONOURED_CHAT = ("best_of", "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
                   "verbosity", "web_search_options", "moderation", "store", "service_tier",
                   "prompt_cache_retention", "prompt_cache_options")
UNHONOURED = UNHONOURED_SAMPLING + UNHONOURED_CHAT


def _refuse_unless_harmless(value: Any, info: ValidationInfo) -> Any:
    """A validator's body for an `UNHONOURED` field: `value` if it asks for nothing."""
    if not _harmless(info.field_name or "", value):
        raise ValueError(f"{info.field_name} is not supported yet (refused rather than ignored)")
    return value


def _harmless(field: str, value: Any) -> bool:
    """Whether `value` of an unhonoured field asks for nothing duet would skip."""
    if value is None:
        return True
    if field == "function_call":
        return value == "none"
    if field == "modalities":
        return value == ["text"]
    if field == "store":  # nothing is stored: only "do not store" is honoured
        return value is False
    if field == "service_tier":  # one tier here
        return value in ("auto", "default")
    if field == "prompt_cache_retention":  # the prefix cache lives in memory (and the KV tiers)
        return value == "in_memory"
    if field in ("functions", "logits_processors"):
        return value == []
    if field == "best_of":  # one candidate is what a chat request gets
        return value == 1
    return False


class _Request(BaseModel):
    # A field nobody declared is refused, whatever its depth: never dropped without a word.
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- requests


class StreamOptions(_Request):
    include_usage: bool = False
    # OpenAI pads stream chunks with random characters against length side channels
    # unless this is false; duet does not: asking for it is refused.
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("include_obfuscation is not supported (refused rather than ignored)")
        return v


class TextContentPart(_Request):
    type: str
    text: str
    prompt_cache_breakpoint: Any = None  # a caching hint: every prefix is cached here anyway

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"only 'text' content parts are supported, got {v!r}")
        return v


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    # An assistant's own response sent back in the conversation carries these, null
    # (duet never fills them): accepted when they say nothing.
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None

    @field_validator("refusal", "annotations", "audio", "function_call")
    @classmethod
    def _echo_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, []):
            raise ValueError(f"a message's {info.field_name} is accepted only as duet's own responses carry it "
                             "(null): refused rather than ignored")
        return v

    @property
    def text(self) -> str:
        """The content's text (earlier calls not included)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if p.text)

    def template_dict(self, fmt: ToolFormat = DUET) -> dict[str, Any]:
        """The message as the chat template takes it. A template that renders tools
        itself (`fmt.native`) gets an assistant's calls and a tool result's call id as
        fields; any other gets the calls written into the content, in `fmt`."""
        # Llama-family templates know no "developer" role; it is OpenAI's new name for system.
        role = "system" if self.role == "developer" else self.role
        if not fmt.native:
            calls = [fmt.call_text(c) for c in self.tool_calls or ()]
            return {"role": role, "content": "\n".join(p for p in (self.text, *calls) if p)}
        out: dict[str, Any] = {"role": role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": parse_arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out



class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # always strict here: every token is checked against the schema


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema.
    `{"type": "json_object", "schema": S}` (an extension several hosted APIs honour, and
    what instructor's JSON_SCHEMA mode sends) is JSON matching S."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def structured(self) -> StructuredOutput | None:
        if self.schema_ is not None and self.type != "json_object":
            raise invalid_request(f"response_format.schema goes with type 'json_object', not {self.type!r} "
                                  "(a json_schema format's schema is response_format.json_schema.schema)",
                                  param="response_format.schema")
        if self.type == "text":
            return None
        if self.type == "json_object":
            if self.schema_ is not None:
                return StructuredOutput.json_schema(self.schema_, param="response_format.schema")
            return StructuredOutput("json_object")
        if self.json_schema is None:
            raise invalid_request("response_format.json_schema is required when type is 'json_schema'",
                                  param="response_format")
        if self.json_schema.schema_ is None:
            return StructuredOutput("json_object")
        return StructuredOutput.json_schema(self.json_schema.schema_)


class _SamplingRequest(_Request):
    """Fields shared by chat and completions; extensions (vLLM's names) marked (ext)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # (ext)
    n: int = Field(1, ge=1, le=128)  # choices; the server's own limit is gateway.max_n
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None  # (ext)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # (ext)
    ignore_eos: bool = False  # (ext)
    include_stop_str_in_output: bool = False  # (ext)
    # Token ids (JSON object keys, so strings) -> a bias in [-100, 100].
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    user: str | None = None
    # (ext) vLLM's: the request's KV is cached and found under this salt only, so a
    # prompt cached by a caller without it shows no timing difference to this one. Under
    # `gateway.cache_isolation: per_key` it partitions the caller's key's namespace.
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # Structured outputs: at most one of these four.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | None = None  # (ext) a JSON schema
    guided_regex: str | None = Field(None, min_length=1)  # (ext)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)  # (ext)
    # Not honoured yet: a value that asks for anything is refused (`_not_honoured`).
    guided_grammar: Any = None  # (ext)
    structured_outputs: Any = None  # (ext)
    logits_processors: Any = None  # (ext)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict | None) -> dict | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise ValueError(f"logit_bias keys are token ids (non-negative integers), got {key!r}")
        return v

    @field_validator(*UNHONOURED_SAMPLING)
    @classmethod
    def _not_honoured(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_harmless(v, info)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured(self) -> StructuredOutput | None:
        """The structured output asked for, if any (a 400 when more than one is)."""
        asked = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice")
                 if getattr(self, name) is not None and getattr(self, name) != ResponseFormat(type="text")]
        if len(asked) > 1:
            raise invalid_request(f"{' and '.join(asked)} both constrain the output; send one of them",
                                  param=asked[1])
        if self.guided_json is not None:
            return StructuredOutput.json_schema(self.guided_json, param="guided_json")
        if self.guided_regex is not None:
            return StructuredOutput("regex", self.guided_regex, param="guided_regex")
        if self.guided_choice is not None:
            return StructuredOutput.choice(self.guided_choice)
        return self.response_format.structured() if self.response_format is not None else None

    def _sampling(self, max_tokens: int, logprobs: int | None, vocab_size: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            sp = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias={int(k): float(b) for k, b in (self.logit_bias or {}).items()},
                structured=self.structured(),
            )
            if vocab_size is not None:
                sp.check_vocab(vocab_size)
            return sp
        except InvalidRequest as e:
            raise invalid_request(str(e), param=e.field) from e


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int | None,
    max_model_len: int | None,
    param: str,
    limit: int | None = None,
    limit_param: str = "max_tokens",
) -> int | None:
    """`requested`, or the rest of the context (at most `limit`) when it is None; a 400
    when it is above the server's `limit`, or context_length_exceeded when prompt +
    completion does not fit."""
    if limit is not None and requested is not None and requested > limit:
        raise invalid_request(f"{limit_param}={requested} is above this server's limit of {limit}", limit_param)
    if num_prompt_tokens is None or max_model_len is None:
        return requested if requested is not None else limit
    remaining = max_model_len - num_prompt_tokens
    if remaining <= 0:
        raise context_length_exceeded(num_prompt_tokens, None, max_model_len, param)
    if requested is None:
        return remaining if limit is None else min(remaining, limit)
    if requested > remaining:
        raise context_length_exceeded(num_prompt_tokens, requested, max_model_len, param)
    return requested


class ChatCompletionRequest(_SamplingRequest):
    _tool_format: ToolFormat = PrivateAttr(default=DUET)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True  # (ext)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # Accepted. Under "required" or a named choice a reply makes exactly one call; under
    # "auto" duet's format makes at most one, a native one (hermes) as many as the model writes.
    parallel_tool_calls: bool | None = None
    best_of: Any = None  # (ext) completions only: refused above 1
    functions: Any = None  # deprecated by OpenAI for tools: refused unless empty
    function_call: Any = None
    # OpenAI-platform features with no counterpart here: refused unless they ask for nothing.
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # Identifiers that change nothing in the answer: accepted.
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # A hint that requests share a prefix: the prefill router's session affinity, as the
    # `x-session-id` header is (the header wins when both are sent).
    prompt_cache_key: str | None = Field(None, max_length=1024)

    @field_validator(*UNHONOURED_CHAT)
    @classmethod
    def _no_tools(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_harmless(v, info)

    def use_tool_format(self, fmt: ToolFormat) -> None:
        """How the served model writes calls (the gateway's `tool_format`; duet's own by default)."""
        self._tool_format = fmt

    def tool_use(self) -> ToolUse | None:
        """The tools the reply may call (None: it calls none); a 400 if they do not fit."""
        try:
            return ToolUse.of(self.tools, self.tool_choice, self._tool_format)
        except ValueError as e:
            raise invalid_request(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from e

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for a chat template that renders them itself; None for any other."""
        use = self.tool_use()
        return use.template_tools() if use is not None and use.format.native else None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them. With duet's tool format, the
        callable tools are described in the system message; a native template gets
        them apart (`template_tools`)."""
        fmt = self._tool_format
        messages = [m.template_dict(fmt) for m in self.messages]
        use = self.tool_use()
        if use is not None and not fmt.native:
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + use.system_prompt()}
            else:
                messages.insert(0, {"role": "system", "content": use.system_prompt()})
        return messages

    def structured(self) -> StructuredOutput | None:
        asked = super().structured()
        use = self.tool_use()
        call = use.structured() if use is not None else None
        if call is not None and asked is not None:
            raise invalid_request(f"tool_choice and {asked.param} both constrain the output; send one of them",
                                  param="tool_choice")
        return call or asked

    def to_sampling_params(
        self,
        num_prompt_tokens: int | None = None,
        max_model_len: int | None = None,
        limit: int | None = None,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """Engine SamplingParams. Without max_tokens/max_completion_tokens the completion
        may use the rest of the context (at most the server's `limit`), so pass
        num_prompt_tokens and max_model_len (given both, an over-long request is a 400
        context_length_exceeded)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = resolve_max_tokens(requested, num_prompt_tokens, max_model_len, "messages", limit, field)
        if max_tokens is None:
            raise ValueError("chat request without max_tokens: pass num_prompt_tokens and max_model_len")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, vocab_size)


class CompletionRequest(_SamplingRequest):
    """After validation `prompt` is either text or a non-empty list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    # Candidates generated server-side; the `n` with the highest cumulative logprob
    # are returned, and usage counts every candidate's tokens (as OpenAI bills it).
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v[0], (str, list)):
            if len(v) > 1:
                raise ValueError(f"batched prompts are not supported; send one prompt per request (got {len(v)})")
            v = v[0]
            if isinstance(v, list) and not v:
                raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 or t > INT32_MAX for t in v):
            raise ValueError("token ids must be non-negative 32-bit integers")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def to_sampling_params(
        self,
        num_prompt_tokens: int | None = None,
        max_model_len: int | None = None,
        limit: int | None = None,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """Engine SamplingParams; max_tokens defaults to 16 as in OpenAI (or the server's
        `limit` when lower). Given num_prompt_tokens and max_model_len, an over-long
        request is a 400."""
        requested = self.max_tokens
        if requested is None:
            requested = COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else min(limit, COMPLETIONS_DEFAULT_MAX_TOKENS)
        max_tokens = resolve_max_tokens(requested, num_prompt_tokens, max_model_len, "prompt", limit)
        assert max_tokens is not None  # `requested` was given
        if self.candidates < self.n:
            raise invalid_request(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.candidates > self.n and self.stream:
            raise invalid_request("best_of > n cannot be streamed: the best candidates are known only at the end",
                                  param="best_of")
        # Ranking needs each sampled token's logprob, asked for or not (0: no alternatives).
        logprobs = 0 if self.logprobs is None and self.candidates > self.n else self.logprobs
        return self._sampling(max_tokens, logprobs, vocab_size)

    @property
    def candidates(self) -> int:
        """How many completions are generated: `best_of`, or `n` without it."""
        return self.n if self.best_of is None else self.best_of


def parse_request(cls: type[_Request], body: bytes | str) -> Any:
    """Parse a raw body into `cls`, raising APIError (400) for malformed JSON, a body
    that is not an object, or invalid fields; for gateways that skip FastAPI's binding."""
    try:
        data = json.loads(body) if body else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid_request(f"Invalid JSON in the request body: {e}") from e
    except RecursionError:
        raise invalid_request("The request body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        bad = _not_unicode(data, "")
    except RecursionError:
        raise invalid_request("The request body is nested too deeply.") from None
    if bad is not None:
        raise invalid_request(f"Invalid value for '{bad}': not valid Unicode (a lone surrogate escape such as "
                              "\\ud800)", param=bad)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e
    except RecursionError:
        raise invalid_request("The request body is nested too deeply.") from None


def _not_unicode(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in `value` that is not valid Unicode:
    JSON may escape a lone UTF-16 surrogate, which no tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            name = str(k).encode("utf-8", "backslashreplace").decode()  # the error must itself be JSON
            where = f"{path}.{name}" if path else name
            if (bad := _not_unicode(k, where)) is not None or (bad := _not_unicode(v, where)) is not None:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (bad := _not_unicode(v, f"{path}[{i}]")) is not None:
                return bad
    return None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=max(0, cached_tokens)),
        )


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


def _created() -> int:
    return int(time.time())


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    """A chunk's delta; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionChunkChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    """Also the streamed chunk of /v1/completions (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


CompletionChunk = CompletionResponse


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "duet"
    root: str | None = None
    max_model_len: int | None = None  # (ext, as vLLM)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def make_response_id(kind: Literal["chat", "completion"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
