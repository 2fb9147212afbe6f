"""Seeded, reproducible workloads: each turns a `WorkloadSpec` into `Session`s.

The same spec and seed always give the same sessions (texts, lengths, think times),
so two servers, or two runs of one server, see identical traffic. Arrival times are
not decided here (see arrivals.py) except by trace replay, whose trace fixes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.distributions import LengthDist, parse_length
from loadgen.prompts import PromptBuilder
from loadgen.records import Session, Turn
from loadgen.tokenizer import count_tokens

# Presets fill the lengths the user did not give (input, output).
PRESET_LENGTHS: dict[str, tuple[str, str]] = {
    "random": ("512", "128"),
    "shared-prefix": ("128", "64"),
    "multi-turn": ("64", "64"),
    "long-in-short-out": ("uniform:1024:2048", "16"),
    "short-in-long-out": ("uniform:32:128", "512"),
    "trace": ("256", "128"),
}
WORKLOADS = tuple(PRESET_LENGTHS)


@dataclass(frozen=True)
class WorkloadSpec:
    """What traffic to generate. Fields beyond the lengths apply to one kind each
    (prefix_* to shared-prefix, turns/think_time_s to multi-turn, trace_path to
    trace); `describe()` records only the relevant ones in reports."""

    kind: str = "random"
    num_prompts: int = 100
    input_len: LengthDist | None = None
    output_len: LengthDist | None = None
    seed: int = 0
    ignore_eos: bool = False
    num_prefixes: int = 4
    prefix_len: int = 256
    share_ratio: float = 1.0
    turns: LengthDist = field(default_factory=lambda: parse_length("4"))
    think_time_s: float = 0.0
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload {self.kind!r} not in {WORKLOADS}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not 0.0 <= self.share_ratio <= 1.0:
            raise ValueError("share_ratio must be in [0, 1]")
        if self.kind == "trace" and not self.trace_path:
            raise ValueError("workload 'trace' needs trace_path")
        inp, out = PRESET_LENGTHS[self.kind]
        if self.input_len is None:
            object.__setattr__(self, "input_len", parse_length(inp))
        if self.output_len is None:
            object.__setattr__(self, "output_len", parse_length(out))

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "num_prompts": self.num_prompts,
            "input_len": self.input_len.spec,
            "output_len": self.output_len.spec,
            "output_len_mode": "forced" if self.ignore_eos else "natural",
            "seed": self.seed,
        }
        if self.kind == "shared-prefix":
            d.update(num_prefixes=self.num_prefixes, prefix_len=self.prefix_len,
                     share_ratio=self.share_ratio)
        if self.kind == "multi-turn":
            d.update(turns=self.turns.spec, think_time_s=self.think_time_s)
        if self.kind == "trace":
            d.update(trace_path=self.trace_path)
        return d


# Every builder draws lengths, share decisions and think times from `rng` and prompt
# words from `text_rng`, so prompt variants (see build_sessions) differ in text only.
Builder = Callable[[WorkloadSpec, PromptBuilder, np.random.Generator, np.random.Generator], list[Session]]


def _single_turn(spec: WorkloadSpec, pb: PromptBuilder, rng: np.random.Generator,
                 text_rng: np.random.Generator) -> list[Session]:
    ins = spec.input_len.sample(rng, spec.num_prompts)
    outs = spec.output_len.sample(rng, spec.num_prompts)
    return [
        Session(i, (Turn(pb.text(int(n), text_rng), int(n), int(o)),))
        for i, (n, o) in enumerate(zip(ins, outs))
    ]


def _shared_prefix(spec: WorkloadSpec, pb: PromptBuilder, rng: np.random.Generator,
                   text_rng: np.random.Generator) -> list[Session]:
    # A shared request draws one of K system prompts; the others get a unique prefix
    # of the same length, so share_ratio changes only the cache hit rate, not the load.
    prefixes = [pb.text(spec.prefix_len, text_rng) for _ in range(spec.num_prefixes)]
    sessions = []
    for s in _single_turn(spec, pb, rng, text_rng):
        if rng.random() < spec.share_ratio:
            system = prefixes[int(rng.integers(0, spec.num_prefixes))]
        else:
            system = pb.text(spec.prefix_len, text_rng)
        sessions.append(Session(s.session_id, s.turns, system, spec.prefix_len))
    return sessions


def _multi_turn(spec: WorkloadSpec, pb: PromptBuilder, rng: np.random.Generator,
                text_rng: np.random.Generator) -> list[Session]:
    sessions, total, sid = [], 0, 0
    while total < spec.num_prompts:
        n_turns = min(int(spec.turns.sample(rng, 1)[0]), spec.num_prompts - total)
        ins = spec.input_len.sample(rng, n_turns)
        outs = spec.output_len.sample(rng, n_turns)
        think = rng.exponential(spec.think_time_s, n_turns) if spec.think_time_s > 0 else np.zeros(n_turns)
        think[0] = 0.0  # the first turn is timed by the arrival process
        turns = tuple(
            Turn(pb.text(int(n), text_rng), int(n), int(o), float(t)) for n, o, t in zip(ins, outs, think)
        )
        sessions.append(Session(sid, turns))
        total += n_turns
        sid += 1
    return sessions


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """JSONL, one request a line: `arrival_time` (or `timestamp`, seconds from the
    start), `prompt` (text) or `prompt_tokens` (or `input_length`), and
    `output_tokens` (or `output_length`, `max_tokens`)."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row and not ({"prompt_tokens", "input_length"} & row.keys()):
            raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_tokens'")
        rows.append(row)
    return rows


def _first(row: dict[str, Any], *keys: str) -> Any:
    return next((row[k] for k in keys if k in row), None)


def _trace(spec: WorkloadSpec, pb: PromptBuilder, rng: np.random.Generator,
           text_rng: np.random.Generator) -> list[Session]:
    rows = load_trace(spec.trace_path)[: spec.num_prompts]
    t0 = min((float(_first(r, "arrival_time", "timestamp") or 0.0) for r in rows), default=0.0)
    sessions = []
    for i, row in enumerate(rows):
        if "prompt" in row:
            text = str(row["prompt"])
            n = count_tokens(pb.tokenizer, text)
        else:
            n = int(_first(row, "prompt_tokens", "input_length"))
            text = pb.text(n, text_rng)
        out = _first(row, "output_tokens", "output_length", "max_tokens")
        out = int(out) if out is not None else int(spec.output_len.sample(rng, 1)[0])
        arrival = float(_first(row, "arrival_time", "timestamp") or 0.0) - t0
        sessions.append(Session(i, (Turn(text, n, out),), arrival_s=arrival))
    return sorted(sessions, key=lambda s: s.arrival_s)


_BUILDERS: dict[str, Builder] = {
    "random": _single_turn,
    "long-in-short-out": _single_turn,
    "short-in-long-out": _single_turn,
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "trace": _trace,
}


# The prompt variant of warm-up requests: words no measured request uses.
WARMUP_VARIANT = 2**31 - 1


def build_sessions(spec: WorkloadSpec, builder: PromptBuilder, variant: int = 0) -> list[Session]:
    """The sessions of a workload; identical for identical (spec, tokenizer, variant).

    Variants share lengths, output budgets and think times, not prompt words:
    a sweep gives each point its own variant, so a server's prefix cache cannot
    serve one point's prompts from an earlier point (or from the warm-up). Trace
    prompts given as text are the same in every variant."""
    rng = np.random.default_rng(spec.seed)
    text_rng = np.random.default_rng([spec.seed, variant])
    return _BUILDERS[spec.kind](spec, builder, rng, text_rng)


def num_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)
