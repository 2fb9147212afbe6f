"""Engine deltas → OpenAI responses: SSE chunks for streaming chat and completions, and
whole responses for the non-streaming path.

A delta is anything shaped like `engine.request.RequestOutput` (text, new_token_ids,
finish_reason, counts, logprobs). Serve charges ~0.6 ms per streamed item, so the
gateway coalesces the deltas that are ready into one SSE event: every builder here
takes a batch, concatenating text and merging logprobs. Token strings for logprobs
come from a `token_text(token_id) -> str` callable the gateway owns (the tokenizer).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from engine.request import FinishReason
from routing.openai.errors import APIError
from routing.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from routing.openai.tools import CallStream, ToolCall, ToolCallDelta, ToolUse

SSE_DONE = "data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # JSON has no -inf

TokenText = Callable[[int], str]


class Delta(Protocol):
    request_id: str
    text: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: Any  # list[TokenLogprob] | None


def token_id_text(token_id: int) -> str:
    """Fallback token string when no tokenizer is at hand (vLLM's `token_id:N` form)."""
    return f"token_id:{token_id}"


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    """Engine finish reason as OpenAI's: `prefill_done` is not an end for the client."""
    if reason is None or reason == FinishReason.PREFILL_DONE:
        return None
    return FinishReason(reason).value


@dataclass
class MergedDelta:
    """Several deltas of one request as one."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None  # OpenAI's name (`openai_finish_reason`)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = -1
    num_output_tokens: int = 0


def merge_deltas(deltas: Iterable[Delta]) -> MergedDelta:
    m = MergedDelta()
    for d in deltas:
        m.text += d.text or ""
        m.token_ids.extend(d.new_token_ids or ())
        if d.logprobs is not None:
            m.logprobs = (m.logprobs or []) + list(d.logprobs)
        reason = openai_finish_reason(d.finish_reason)
        if reason is not None:
            m.finish_reason = reason
        m.num_prompt_tokens = max(m.num_prompt_tokens, d.num_prompt_tokens or 0)
        if m.num_cached_tokens < 0 and d.num_cached_tokens is not None and d.num_cached_tokens >= 0:
            m.num_cached_tokens = d.num_cached_tokens
        m.num_output_tokens = max(m.num_output_tokens, d.num_output_tokens or 0)
    return m


def _lp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB) if not math.isnan(x) else _MIN_LOGPROB


def chat_logprobs(logprobs: Sequence, token_text: TokenText = token_id_text) -> ChatLogprobs:
    """`{"content": [{token, logprob, bytes, top_logprobs: [...]}]}` from TokenLogprobs."""

    def top(tid: int, lp: float) -> ChatTopLogprob:
        s = token_text(tid)
        return ChatTopLogprob(token=s, logprob=_lp(lp), bytes=list(s.encode("utf-8")))

    content = []
    for t in logprobs:
        s = token_text(t.token_id)
        content.append(
            ChatTokenLogprob(
                token=s,
                logprob=_lp(t.logprob),
                bytes=list(s.encode("utf-8")),
                top_logprobs=[top(tid, lp) for tid, lp in t.top],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    logprobs: Sequence, token_text: TokenText = token_id_text, text_offset: int = 0
) -> CompletionLogprobs:
    """Legacy `{tokens, token_logprobs, top_logprobs, text_offset}`; `text_offset` is where
    the first token starts in the completion text. The top dicts hold the top-N plus
    the sampled token, as vLLM does."""
    out = CompletionLogprobs()
    offset = text_offset
    for t in logprobs:
        s = token_text(t.token_id)
        out.tokens.append(s)
        out.token_logprobs.append(_lp(t.logprob))
        top = {token_text(tid): _lp(lp) for tid, lp in t.top}
        top.setdefault(s, _lp(t.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(s)
    return out


def sse(obj: BaseModel | dict, **dump: Any) -> str:
    """One SSE event: `data: {json}\\n\\n`."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json(**dump)
    else:
        payload = json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n"


def sse_error(err: APIError) -> str:
    """An error after the stream started (headers already sent with 200): the `openai`
    client raises APIError on an event carrying `error`."""
    return sse(err.body())


class _Stream:
    def __init__(
        self,
        response_id: str,
        model: str,
        *,
        include_usage: bool = False,
        logprobs: bool = False,
        token_text: TokenText = token_id_text,
        created: int | None = None,
        index: int = 0,
    ):
        self.response_id = response_id
        self.index = index  # the choice this stream builds
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.token_text = token_text
        self.created = created if created is not None else int(time.time())
        self.num_prompt_tokens = 0
        self.num_cached_tokens = -1
        self.num_output_tokens = 0
        self.text_len = 0
        self.finish_reason: str | None = None
        self._exclude = None if include_usage else {"usage"}

    def _absorb(self, m: MergedDelta) -> None:
        self.num_prompt_tokens = max(self.num_prompt_tokens, m.num_prompt_tokens)
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = m.num_cached_tokens
        # Count tokens seen too: a disaggregated request's first token comes from prefill.
        self.num_output_tokens = max(self.num_output_tokens + len(m.token_ids), m.num_output_tokens)
        self.text_len += len(m.text)
        if m.finish_reason is not None:
            self.finish_reason = m.finish_reason

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def chunk(self, deltas: Sequence[Delta]) -> str:
        """One SSE event for a batch of deltas; "" when it would carry nothing."""
        raise NotImplementedError

    def _usage_chunk(self, usage: UsageInfo) -> BaseModel:
        """The endpoint's final chunk carrying only `usage` (each stream defines it)."""
        raise NotImplementedError

    def done(self, usage: UsageInfo | None = None) -> str:
        """The closing events: the usage chunk (choices empty) when include_usage, then
        `[DONE]`. `usage` overrides the counts gathered from the deltas."""
        if not self.include_usage:
            return SSE_DONE
        return sse(self._usage_chunk(usage or self.usage)) + SSE_DONE


class ChatStream(_Stream):
    """One chat request's chunk builder: the first event carries `role: assistant`.

    With `tools`: under "required" or a named choice the reply is a call, streamed as
    `tool_calls` pieces (routing/openai/tools.py `CallStream`); under "auto" a reply
    that may be a call is held back until it ends (then sent whole) or shows it is not
    one (it does not start with `{`)."""

    def __init__(self, *args: Any, tools: ToolUse | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._sent_role = False
        self.tools = tools
        self._call = CallStream(tools.format) if tools is not None and tools.choice != "auto" else None
        self._held: list[Delta] | None = [] if tools is not None and self._call is None else None

    def chunk(self, deltas: Sequence[Delta]) -> str:
        """One SSE event for a batch of deltas; "" when it would carry nothing."""
        m = merge_deltas(deltas)
        self._absorb(m)
        if self._call is not None:
            pieces = self._call.feed(m.text)
            finish = "tool_calls" if m.finish_reason == "stop" else m.finish_reason
            if not pieces and finish is None:
                return ""
            return self._event(DeltaMessage(tool_calls=pieces or None), m, finish)
        if self._held is not None and self.tools is not None:
            self._held.extend(deltas)
            m = merge_deltas(self._held)
            if m.finish_reason is None and (self.tools.choice != "auto" or self.tools.format.may_start_call(m.text)):
                return ""
            self._held = None
            calls = self.tools.parse(m.text) if m.finish_reason is not None else []
            if calls:
                pieces = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
                return self._event(DeltaMessage(tool_calls=pieces), m, "tool_calls")
        if self._sent_role and not m.text and not m.token_ids and m.finish_reason is None:
            return ""
        return self._event(DeltaMessage(content=m.text), m, m.finish_reason)

    def _event(self, delta: DeltaMessage, m: MergedDelta, finish_reason: str | None) -> str:
        if not self._sent_role:
            delta.role = "assistant"
            self._sent_role = True
        lp = chat_logprobs(m.logprobs, self.token_text) if self.logprobs and m.logprobs else None
        choice = ChatCompletionChunkChoice(index=self.index, delta=delta, logprobs=lp, finish_reason=finish_reason)
        return sse(self._chunk([choice]), exclude=self._exclude)

    def _chunk(self, choices, usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)


class CompletionStream(_Stream):
    """One /v1/completions request's chunk builder (`text_completion` objects)."""

    def chunk(self, deltas: Sequence[Delta]) -> str:
        m = merge_deltas(deltas)
        offset = self.text_len
        self._absorb(m)
        if not m.text and not m.token_ids and m.finish_reason is None:
            return ""
        lp = completion_logprobs(m.logprobs, self.token_text, offset) if self.logprobs and m.logprobs else None
        choice = CompletionChoice(index=self.index, text=m.text, logprobs=lp, finish_reason=m.finish_reason)
        return sse(self._chunk([choice]), exclude=self._exclude)

    def _chunk(self, choices, usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._chunk([], usage)


class ChoiceStreams:
    """A streamed request's `n` choices: each choice's builder (its `index` set) gets
    the outputs of its own sequence, by request id; the usage chunk sums them."""

    def __init__(self, builders: dict[str, ChatStream] | dict[str, CompletionStream]):
        self.builders: dict[str, _Stream] = dict(builders)

    def chunk(self, deltas: Sequence[Delta]) -> str:
        if len(self.builders) == 1:
            return next(iter(self.builders.values())).chunk(deltas)
        groups: dict[str, list[Delta]] = {}
        for d in deltas:
            groups.setdefault(d.request_id, []).append(d)
        return "".join(self.builders[rid].chunk(group) for rid, group in groups.items())

    def done(self) -> str:
        streams = list(self.builders.values())
        first = streams[0]
        usage = UsageInfo.of(first.num_prompt_tokens, sum(s.num_output_tokens for s in streams),
                             first.num_cached_tokens)
        return first.done(usage)


def merge_choices(
    responses: Sequence[ChatCompletionResponse | CompletionResponse],
    billed: Sequence[ChatCompletionResponse | CompletionResponse] | None = None,
):
    """One response of `n` choices from one response per choice (in choice order).
    Its usage counts the prompt once and the completion tokens of `billed` (every
    candidate generated, when only the best are returned), by default of `responses`."""
    first = responses[0].model_copy()
    choices = []
    for i, r in enumerate(responses):
        choice = r.choices[0].model_copy(update={"index": i})
        choices.append(choice)
    first.choices = choices  # type: ignore[assignment]
    usages = [r.usage for r in (responses if billed is None else billed) if r.usage is not None]
    if usages:
        details = usages[0].prompt_tokens_details
        first.usage = UsageInfo.of(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                                   details.cached_tokens if details else 0)
    return first


def best_of(candidates: Sequence[Sequence[Delta]], n: int) -> list[int]:
    """The indexes of the `n` candidates whose sampled tokens have the highest
    cumulative logprob, best first (`best_of`, as OpenAI and vLLM rank); ties keep
    candidate order. Every candidate's tokens must carry their logprobs."""
    def score(deltas: Sequence[Delta]) -> float:
        return sum(lp.logprob for d in deltas for lp in (d.logprobs or ()) if lp is not None)

    return sorted(range(len(candidates)), key=lambda i: -score(candidates[i]))[:n]


def _usage(m: MergedDelta) -> UsageInfo:
    return UsageInfo.of(m.num_prompt_tokens, max(m.num_output_tokens, len(m.token_ids)), m.num_cached_tokens)


def build_chat_response(
    response_id: str,
    model: str,
    deltas: Sequence[Delta],
    *,
    logprobs: bool = False,
    token_text: TokenText = token_id_text,
    created: int | None = None,
    tools: ToolUse | None = None,
) -> ChatCompletionResponse:
    """A whole `chat.completion` from all of a request's deltas; with `tools`, a reply
    that is a call comes back as `tool_calls` (finish reason "tool_calls")."""
    m = merge_deltas(deltas)
    lp = chat_logprobs(m.logprobs or [], token_text) if logprobs else None
    calls: list[ToolCall] = tools.parse(m.text) if tools is not None and m.finish_reason else []
    message = ChatResponseMessage(tool_calls=calls) if calls else ChatResponseMessage(content=m.text)
    choice = ChatCompletionChoice(
        message=message, logprobs=lp, finish_reason="tool_calls" if calls else m.finish_reason
    )
    return ChatCompletionResponse(
        id=response_id, created=created or int(time.time()), model=model, choices=[choice], usage=_usage(m)
    )


def build_completion_response(
    response_id: str,
    model: str,
    deltas: Sequence[Delta],
    *,
    logprobs: bool = False,
    token_text: TokenText = token_id_text,
    created: int | None = None,
) -> CompletionResponse:
    """A whole `text_completion` from all of a request's deltas."""
    m = merge_deltas(deltas)
    lp = completion_logprobs(m.logprobs or [], token_text) if logprobs else None
    choice = CompletionChoice(text=m.text, logprobs=lp, finish_reason=m.finish_reason)
    return CompletionResponse(
        id=response_id, created=created or int(time.time()), model=model, choices=[choice], usage=_usage(m)
    )
