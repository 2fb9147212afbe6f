"""Tool calls (OpenAI's `tools` and `tool_choice`) for a model with no tool-call format
of its own, such as the embedded SmolLM2: the tools are described to the model in a
system message, and a call is the whole reply as one JSON object,
`{"name": <a tool's name>, "arguments": {...}}`.

- `tool_choice` "required", or a named function: the reply is constrained to such an
  object by a JSON schema (one alternative per allowed tool, each with its own
  `parameters`), so it is always a well-formed call of an offered tool;
- "auto" (the default when tools are given): the model decides. A reply that is
  exactly such an object is returned as a call, anything else as content (what vLLM's
  tool parsers do);
- "none": the tools are not shown and nothing is parsed.

One call per reply: `parallel_tool_calls` is accepted, and the model may make one.

Streamed, a call under "required" or a named choice goes out as OpenAI streams one: a
first `delta.tool_calls` entry with the id and the name once the reply's head
(`{"name": ..., "arguments": `) is complete, then the arguments' text in fragments as
it is generated (`CallStream`). Under "auto" the reply is held until it is known to be
a call (it ends as one) or not (it does not start with `{`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured import StructuredOutput


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # always strict under "required" or a named choice


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(default_factory=_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed call's piece (`choices[].delta.tool_calls[]`): the first carries the
    id, type and name; later ones only argument text."""

    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


# A call's head, as the model writes it (the grammar writes exactly `{"name": "x", "arguments": `).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')


def _arguments_text(text: str) -> str | None:
    """The raw text of a whole call's arguments (the outer object's `}` cut), or None
    if `text` does not start with a call's head."""
    head = _HEAD.match(text)
    if head is None:
        return None
    rest = text[head.end():].rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else None


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and which of them the reply may (or must) call."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "required"] | str  # a tool's name: that tool must be called

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None) -> ToolUse | None:
        """None when no tool can be called (no tools, or tool_choice "none"); a
        ValueError naming the problem when the choice does not fit the tools."""
        if isinstance(choice, NamedToolChoice):
            wanted: str = choice.function.name
        else:
            wanted = choice or "auto"
        if not tools:
            if wanted in ("none", "auto"):
                return None
            raise ValueError(f"tool_choice {wanted!r} needs tools")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if wanted == "none":
            return None
        if wanted not in ("auto", "required") and wanted not in names:
            raise ValueError(f"tool_choice names {wanted!r}, which is not one of the tools")
        return cls(tuple(tools), wanted)

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.function.name == self.choice)

    def system_prompt(self) -> str:
        specs = [{"name": t.function.name, "description": t.function.description or "",
                  "parameters": t.function.parameters or {"type": "object", "properties": {}}}
                 for t in self.callable]
        must = "You must call one of them." if self.choice != "auto" else \
            "Call one only when it helps; otherwise answer in plain text."
        return ("You can call these functions:\n" + json.dumps(specs) + "\n" + must +
                ' To call a function, reply with only a JSON object: {"name": <function name>, '
                '"arguments": <an object of its arguments>}.')

    def structured(self) -> StructuredOutput | None:
        """The grammar a reply must follow: a call, unless the model may answer in text."""
        if self.choice == "auto":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.function.name},
                                 "arguments": t.function.parameters or {"type": "object", "properties": {}}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in self.callable]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return StructuredOutput.json_schema(schema, param="tools")

    def parse(self, text: str) -> ToolCall | None:
        """The call `text` makes, if it is exactly one call of a callable tool."""
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        names = {t.function.name for t in self.callable}
        if not (isinstance(doc, dict) and set(doc) == {"name", "arguments"} and doc["name"] in names
                and isinstance(doc["arguments"], dict)):
            return None
        raw = _arguments_text(text)  # as written, so a streamed call's fragments add up to the same
        arguments = raw if raw is not None and _loads(raw) == doc["arguments"] else json.dumps(doc["arguments"])
        return ToolCall(function=FunctionCall(name=doc["name"], arguments=arguments))


class CallStream:
    """One reply under "required" or a named choice (always a call), as stream pieces:
    the head once its name is known, then argument text as it comes. The outer
    object's closing `}` (and blanks before it) is held back until the reply ends."""

    def __init__(self) -> None:
        self.text = ""
        self.started = False
        self._sent = 0  # argument characters sent
        self._start = 0  # where the arguments begin in `text`

    def feed(self, text: str, finish_reason: str | None) -> list[ToolCallDelta]:
        """The pieces `text` completes; `finish_reason`: set on the reply's last text
        ("stop": the call is whole, its closing `}` is dropped; else all is sent)."""
        self.text += text
        pieces: list[ToolCallDelta] = []
        if not self.started:
            head = _HEAD.match(self.text)
            if head is None:
                return pieces
            self.started, self._start = True, head.end()
            pieces.append(ToolCallDelta(id=_call_id(), type="function",
                                        function=FunctionCallDelta(name=head.group(1), arguments="")))
        args = self.text[self._start:].rstrip()
        if finish_reason in (None, "stop") and args.endswith("}"):  # may close (or closes) the call itself
            args = args[:-1].rstrip()
        if len(args) > self._sent:
            pieces.append(ToolCallDelta(function=FunctionCallDelta(arguments=args[self._sent:])))
            self._sent = len(args)
        return pieces


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_text(call: ToolCall) -> str:
    """An earlier call of the conversation, as the model would have written it."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return json.dumps({"name": call.function.name, "arguments": arguments})
