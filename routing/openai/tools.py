"""Tool calls (OpenAI's `tools` and `tool_choice`), in one of two formats
(`ToolFormat`), chosen by what the checkpoint's chat template knows:

- **duet** (a template that knows no tools, such as the embedded SmolLM2's): the
  tools are described to the model in a system message, and a call is the whole reply
  as one JSON object, `{"name": <a tool's name>, "arguments": {...}}`; earlier calls
  go back into the prompt in that form.
- **hermes** (a template that renders `tools` and writes calls in `<tool_call>` tags,
  as Hermes, Qwen 2.5/3 and many Llama fine-tunes do): the template itself gets the
  tools, the earlier calls and the `tool` results; a call is
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and a reply may make
  several.

In both:

- `tool_choice` "required", or a named function: the reply is constrained to one
  call (one alternative per allowed tool, each with its own `parameters` schema), so
  it is always a well-formed call of an offered tool;
- "auto" (the default when tools are given): the model decides. A reply that is
  only calls is returned as calls, anything else as content (what vLLM's tool
  parsers do);
- "none": the tools are not shown and nothing is parsed.

Streamed, a call under "required" or a named choice goes out as OpenAI streams one: a
first `delta.tool_calls` entry with the id and the name once the call's head
(`{"name": ..., "arguments": `) is complete, then the arguments' text in fragments as
it is generated (`CallStream`). Under "auto" the reply is held until it is known to be
calls (it ends as calls) or not (it cannot start as one).
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
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # always strict under "required" or a named choice


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

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


# A call's JSON head, as the model writes it (the grammar writes exactly `{"name": "x", "arguments": `).
_HEAD = r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*'
_HEAD_RE = re.compile(_HEAD)
# Compact JSON inside a call's grammar, as engine/structured.py writes documents.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    """How one family of models writes a tool call: the text around the call's JSON
    object, and whether its chat template renders the tools, earlier calls and their
    results itself (`native`) or duet describes them in plain messages."""

    name: Literal["duet", "hermes"]
    native: bool
    open: str = ""
    close: str = ""

    @property
    def head(self) -> re.Pattern[str]:
        return re.compile(r"\s*" + re.escape(self.open.strip()) + _HEAD) if self.open else _HEAD_RE

    def grammar(self, call_schema: dict[str, Any]) -> StructuredOutput:
        """One call whose JSON object follows `call_schema`, with this format's tags."""
        if not self.open and not self.close:
            return StructuredOutput.json_schema(call_schema, param="tools")
        schema = {**call_schema, "x-guidance": _JSON_STYLE}
        lark = f"start: {json.dumps(self.open)} call {json.dumps(self.close)}\ncall: %json {json.dumps(schema)}"
        return StructuredOutput("lark", lark, "tools")

    def split(self, text: str) -> list[str] | None:
        """The JSON text of each call when `text` is only calls (blanks between), else None."""
        if not self.open:
            return [text]
        parts: list[str] = []
        rest = text.strip()
        while rest:
            if not rest.startswith(self.open.strip()):
                return None
            end = rest.find(self.close.strip())
            if end < 0:
                return None
            parts.append(rest[len(self.open.strip()):end])
            rest = rest[end + len(self.close.strip()):].lstrip()
        return parts or None

    def may_start_call(self, text: str) -> bool:
        """Whether `text` (a reply so far) can still turn out to be calls."""
        start = text.lstrip()
        opening = (self.open.strip() or "{")
        return start.startswith(opening) or opening.startswith(start)

    def call_text(self, call: ToolCall) -> str:
        """An earlier call, as the model would have written it."""
        arguments = parse_arguments(call.function.arguments)
        return self.open + json.dumps({"name": call.function.name, "arguments": arguments}) + self.close


DUET = ToolFormat("duet", native=False)
HERMES = ToolFormat("hermes", native=True, open="<tool_call>\n", close="\n</tool_call>")
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (DUET, HERMES)}


def tool_format(chat_template: str | None, configured: str = "auto") -> ToolFormat:
    """The format of `gateway.tool_format`; "auto": hermes for a chat template that
    renders `tools` and writes `<tool_call>` tags, duet's own for any other."""
    if configured != "auto":
        return FORMATS[configured]
    template = chat_template or ""
    return HERMES if "tools" in template and "<tool_call>" in template else DUET


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at `text[start:]` (after blanks) ends,
    one past its closing bracket; None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif not c.isspace() and depth == 0:
            return None  # not an object: the caller's parse refuses it
    return None


def _arguments_text(call_json: str) -> str | None:
    """The raw text of a call's arguments as written, or None if `call_json` does not
    start with a call's head."""
    head = _HEAD_RE.match(call_json)
    if head is None:
        return None
    end = _value_end(call_json, head.end())
    return call_json[head.end():end] if end is not None else None


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and which of them the reply may (or must) call."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "required"] | str  # a tool's name: that tool must be called
    format: ToolFormat = DUET

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None, fmt: ToolFormat = DUET) -> ToolUse | None:
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
        return cls(tuple(tools), wanted, fmt)

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.function.name == self.choice)

    def template_tools(self) -> list[dict[str, Any]]:
        """The callable tools as a native chat template takes them (OpenAI's form)."""
        return [t.model_dump(exclude_none=True) for t in self.callable]

    def system_prompt(self) -> str:
        """The tools described for a model whose template knows none (duet's format)."""
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
        return self.format.grammar(schema)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls `text` makes when it is only calls of callable tools (duet's format:
        exactly one); [] when it is anything else (then it is content)."""
        calls = []
        for part in self.format.split(text) or ():
            call = self._call(part)
            if call is None:
                return []
            calls.append(call)
        return calls

    def _call(self, call_json: str) -> ToolCall | None:
        try:
            doc = json.loads(call_json)
        except ValueError:
            return None
        names = {t.function.name for t in self.callable}
        if not (isinstance(doc, dict) and set(doc) == {"name", "arguments"} and doc["name"] in names
                and isinstance(doc["arguments"], dict)):
            return None
        raw = _arguments_text(call_json)  # as written, so a streamed call's fragments add up to the same
        arguments = raw if raw is not None and parse_arguments(raw) == doc["arguments"] \
            else json.dumps(doc["arguments"])
        return ToolCall(function=FunctionCall(name=doc["name"], arguments=arguments))


class CallStream:
    """One reply under "required" or a named choice (always one call), as stream
    pieces: the head once its name is known, then the arguments' text as it comes,
    up to the arguments' own closing bracket (what follows closes the call)."""

    def __init__(self, fmt: ToolFormat = DUET) -> None:
        self.text = ""
        self.started = False
        self._head = fmt.head
        self._sent = 0  # argument characters sent
        self._start = 0  # where the arguments begin in `text`

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The pieces `text` completes."""
        self.text += text
        pieces: list[ToolCallDelta] = []
        if not self.started:
            head = self._head.match(self.text)
            if head is None:
                return pieces
            self.started, self._start = True, head.end()
            pieces.append(ToolCallDelta(id=_call_id(), type="function",
                                        function=FunctionCallDelta(name=head.group(1), arguments="")))
        while not self._sent and self.text[self._start:self._start + 1].isspace():
            self._start += 1  # blanks after `"arguments":` that came after the head matched
        args = self.text[self._start:_value_end(self.text, self._start)]
        if len(args) > self._sent:
            pieces.append(ToolCallDelta(function=FunctionCallDelta(arguments=args[self._sent:])))
            self._sent = len(args)
        return pieces


def parse_arguments(text: str) -> object:
    """A call's arguments as a value: the JSON's, or the text itself when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text
