"""The grammar study's own logic (scripts/experiments/grammar.py): its test documents are what it says they are, and
the byte alphabet it gives outlines-core is GPT-2's. Runs no grammar library."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jsonschema
import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "experiments" / "grammar.py"
_spec = importlib.util.spec_from_file_location("grammar_study", _SCRIPT)
assert _spec is not None and _spec.loader is not None
grammar = importlib.util.module_from_spec(_spec)
sys.modules["grammar_study"] = grammar
_spec.loader.exec_module(grammar)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(grammar.SCHEMAS))
def test_valid_documents_validate_and_invalid_ones_do_not(name):
    schema = grammar.SCHEMAS[name]
    jsonschema.validate(grammar.VALID[name], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(grammar.INVALID[name], schema)


def test_byte_alphabet_is_gpt2s():
    alphabet = grammar._byte_alphabet()
    assert len(set(alphabet.values())) == 256
    assert alphabet[ord("a")] == "a" and alphabet[ord("{")] == "{"
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"  # as the vocabulary writes them


def test_the_table_has_a_row_per_result():
    report = {"results": [
        {"library": "x", "schema": "person", "compile_s": [0.005], "mask_b1_us": [7.0], "mask_b32_ms": [0.2],
         "apply_b32_us": [140.0], "valid_accepted": True, "invalid_refused": True, "error": None},
        {"library": "y", "schema": "invoice", "compile_s": [], "mask_b1_us": [], "mask_b32_ms": [],
         "apply_b32_us": [], "valid_accepted": None, "invalid_refused": None, "error": "ValueError: nope"},
    ]}
    rows = grammar.table(report).splitlines()
    assert len(rows) == 4
    assert "| x | person | 5.0 | 7.0 | 0.20 | 140 | True | True |" == rows[2]
    assert "error: ValueError: nope" in rows[3]
