"""`scripts/experiments/grammar.py`: which grammar library structured outputs should be built on,
measured on this CPU with the served model's tokenizer.

    python scripts/experiments/grammar.py [--model smollm2-135m] [--runs 3] [--json out.json]

For each library that is installed (xgrammar, llguidance, outlines-core; none is a
dependency of duet yet) and each test schema:

- **compile**: seconds from a JSON schema to a token-level matcher, cold (a new
  compiler, no cache). llguidance builds its token trie lazily, so its figure
  includes the first mask; the tokenizer's own preparation is timed apart, once.
- **mask**: the time to fill one row's allowed-token bitmask, per generated token,
  walking a valid document token by token: at batch 1, and per step at batch 32
  (32 matchers filled one after another on one thread, as an engine step would).
- **apply**: putting a batch-32 bitmask on float32 logits of the vocabulary's width
  (after a first call, timed apart: llguidance compiles a kernel on it).
- **correct**: every token of a valid document is accepted and the matcher accepts at
  its end; a document that breaks the schema is refused at some token.

Medians of `--runs`; prints a table and writes JSON with CPU flags and every run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run as a script

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags

BATCH = 32

# The schemas: a small one, a realistic extraction schema (nesting, arrays, enums,
# patterns, bounds, optional fields), and `json_object` mode (any JSON object).
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
INVOICE = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
        "issued": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "status": {"enum": ["draft", "sent", "paid", "overdue"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 80},
                "email": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "country": {"type": "string", "minLength": 2, "maxLength": 2}},
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tax_rate": {"type": "number"},
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["invoice_number", "issued", "currency", "status", "customer", "lines", "paid"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}

VALID = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "invoice": {
        "invoice_number": "INV-20261", "issued": "2026-12-02", "currency": "EUR", "status": "sent",
        "customer": {"name": "Mill & Engine Ltd", "email": "accounts@mill.example",
                     "address": {"street": "12 Analytical Row", "city": "London", "country": "GB"}},
        "lines": [{"description": "Difference engine, mark II", "quantity": 1, "unit_price": 17470.5},
                  {"description": "Punched cards (box of 500)", "quantity": 12, "unit_price": 9.99, "tax_rate": 0.2}],
        "paid": False, "notes": None,
    },
    "json_object": {"answer": [1, 2.5, "three"], "nested": {"ok": True, "none": None}},
}
INVALID = {
    "person": {"name": "Ada Lovelace", "age": "thirty-six"},
    "invoice": {**VALID["invoice"], "currency": "XYZ"},
    "json_object": [1, 2, 3],  # an array, not an object
}
SCHEMAS = {"person": PERSON, "invoice": INVOICE, "json_object": ANY_OBJECT}


def dump(doc: Any) -> str:
    """The document as a model would write it: JSON with a space after , and :."""
    return json.dumps(doc, separators=(", ", ": "))


@dataclass
class Result:
    library: str
    schema: str
    compile_s: list[float] = field(default_factory=list)
    mask_b1_us: list[float] = field(default_factory=list)  # per token
    mask_b32_ms: list[float] = field(default_factory=list)  # per step, 32 rows
    apply_b32_us: list[float] = field(default_factory=list)
    valid_accepted: bool | None = None
    invalid_refused: bool | None = None
    error: str | None = None


class Backend:
    """One library behind the four operations the benchmark times."""

    name = ""
    vocab_size = 0

    def compile(self, schema: dict) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def allocate(self, batch: int) -> torch.Tensor: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def accepting(self, matcher: Any) -> bool: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class XGrammar(Backend):
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.vocab_size = self.info.vocab_size

    def compile(self, schema: dict) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if schema == ANY_OBJECT:
            return compiler.compile_json_schema(json.dumps(schema))
        return compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_completed()) if hasattr(matcher, "is_completed") else bool(matcher.is_terminated())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance(Backend):
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = self.tok.vocab_size

    def compile(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        bitmask = self.allocate(1)
        self.fill(m, bitmask, 0)  # its token trie and lexer are built lazily: count the first mask
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def allocate(self, batch: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


class OutlinesCore(Backend):
    name = "outlines-core"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocab_size = vocab_size
        self.vocab = outlines_core.Vocabulary(hf_tokenizer.eos_token_id, _token_bytes(hf_tokenizer))

    def compile(self, schema: dict) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def allocate(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask[row]
        matcher.write_mask_into(r.data_ptr(), r.numel(), r.element_size())

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished()) or self.vocab_eos_allowed(matcher)

    def vocab_eos_allowed(self, matcher: Any) -> bool:
        return self.vocab.get_eos_token_id() in matcher.get_tokens()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))


def _token_bytes(hf_tokenizer) -> dict[bytes, list[int]]:
    """Each token's bytes, for a byte-level BPE vocabulary (GPT-2's byte alphabet)
    as the embedded model's is; special tokens excluded (they are never JSON)."""
    decode = {c: b for b, c in _byte_alphabet().items()}
    special = set(hf_tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for token, tid in hf_tokenizer.get_vocab().items():
        if tid in special or tid == hf_tokenizer.eos_token_id:
            continue
        try:
            raw = bytes(decode[c] for c in token)
        except KeyError:  # not a byte-level token
            raw = token.encode()
        out.setdefault(raw, []).append(tid)
    return out


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte as the printable character its
    vocabulary writes it with (printable Latin-1 bytes as themselves, the others
    shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


BACKENDS: dict[str, Callable[..., Backend]] = {"xgrammar": XGrammar, "llguidance": LLGuidance,
                                              "outlines-core": OutlinesCore}


def walk(backend: Backend, compiled: Any, tokens: list[int]) -> bool:
    """Whether every token is accepted and the matcher accepts at the end."""
    m = backend.matcher(compiled)
    bitmask = backend.allocate(1)
    for t in tokens:
        backend.fill(m, bitmask, 0)
        if not backend.accept(m, t):
            return False
    return backend.accepting(m)


def time_masks(backend: Backend, compiled: Any, tokens: list[int]) -> tuple[float, float]:
    """(µs per token at batch 1, ms per step at batch 32), walking `tokens`."""
    m = backend.matcher(compiled)
    bitmask = backend.allocate(1)
    spent = 0.0
    for t in tokens:
        t0 = time.perf_counter()
        backend.fill(m, bitmask, 0)
        spent += time.perf_counter() - t0
        backend.accept(m, t)
    b1 = spent / len(tokens) * 1e6
    matchers = [backend.matcher(compiled) for _ in range(BATCH)]
    bitmask = backend.allocate(BATCH)
    spent = 0.0
    for t in tokens:
        t0 = time.perf_counter()
        for row, mm in enumerate(matchers):
            backend.fill(mm, bitmask, row)
        spent += time.perf_counter() - t0
        for mm in matchers:
            backend.accept(mm, t)
    return b1, spent / len(tokens) * 1e3


def run(model: str, runs: int, libraries: list[str]) -> dict:
    from engine.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    hf = load_tokenizer(model).hf
    vocab_size = len(hf)
    docs = {name: hf.encode(dump(doc), add_special_tokens=False) for name, doc in VALID.items()}
    bad = {name: hf.encode(dump(doc), add_special_tokens=False) for name, doc in INVALID.items()}
    results: list[Result] = []
    setup: dict[str, float | str] = {}
    first_apply: dict[str, float] = {}
    for lib in libraries:
        t0 = time.perf_counter()
        try:
            backend = BACKENDS[lib](hf, vocab_size)
        except ImportError as e:
            setup[lib] = f"not installed ({e.name})"
            continue
        setup[lib] = round(time.perf_counter() - t0, 4)
        # The first apply may build a kernel (llguidance's compiles one): timed apart.
        logits, bitmask = torch.randn(BATCH, backend.vocab_size), backend.allocate(BATCH)
        t0 = time.perf_counter()
        backend.apply(logits, bitmask)
        first_apply[lib] = round(time.perf_counter() - t0, 4)
        for name, schema in SCHEMAS.items():
            r = Result(lib, name)
            results.append(r)
            try:
                for _ in range(runs):
                    t0 = time.perf_counter()
                    compiled = backend.compile(schema)
                    r.compile_s.append(time.perf_counter() - t0)
                    b1, b32 = time_masks(backend, compiled, docs[name])
                    r.mask_b1_us.append(b1)
                    r.mask_b32_ms.append(b32)
                    logits = torch.randn(BATCH, backend.vocab_size)
                    bitmask = backend.allocate(BATCH)
                    t0 = time.perf_counter()
                    backend.apply(logits, bitmask)
                    r.apply_b32_us.append((time.perf_counter() - t0) * 1e6)
                r.valid_accepted = walk(backend, compiled, docs[name])
                r.invalid_refused = not walk(backend, compiled, bad[name])
            except Exception as e:  # a library that cannot do this schema: a finding, not a crash
                r.error = f"{type(e).__name__}: {e}"[:300]
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                    "torch_threads": torch.get_num_threads()},
        "model": model,
        "vocab_size": vocab_size,
        "doc_tokens": {k: len(v) for k, v in docs.items()},
        "tokenizer_setup_s": setup,
        "first_apply_s": first_apply,
        "results": [asdict(r) for r in results],
    }


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def table(report: dict) -> str:
    lines = ["| library | schema | compile (ms) | mask b=1 (µs/token) | mask b=32 (ms/step) | apply b=32 (µs) "
             "| valid accepted | invalid refused |", "|---|---|---:|---:|---:|---:|---|---|"]
    for r in report["results"]:
        if r["error"]:
            lines.append(f"| {r['library']} | {r['schema']} | error: {r['error'][:80]} | | | | | |")
            continue
        c, b1, b32, ap = (_med(r[k]) for k in ("compile_s", "mask_b1_us", "mask_b32_ms", "apply_b32_us"))
        lines.append(f"| {r['library']} | {r['schema']} | {c * 1e3:.1f} | {b1:.1f} | {b32:.2f} | {ap:.0f} "
                     f"| {r['valid_accepted']} | {r['invalid_refused']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/experiments/grammar.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--library", action="append", choices=list(BACKENDS),
                   help="only these (repeatable; default: every installed one)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    report = run(args.model, args.runs, args.library or list(BACKENDS))
    print(f"tokenizer setup (s): {report['tokenizer_setup_s']}; first apply (s): {report['first_apply_s']}; "
          f"document tokens: {report['doc_tokens']}")
    print(table(report))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
