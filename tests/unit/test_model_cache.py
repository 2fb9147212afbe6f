"""The converted copy of a GGUF (engine/model_cache.py): it loads what the GGUF loads,
bit for bit, and its writes are atomic, keyed by the file, and optional."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import model_cache
from engine.tokenizer import Tokenizer
from engine.weights import load_checkpoint, resolve_checkpoint

REPO = Path(__file__).resolve().parents[2]
# Real GGUF loads and Python subprocesses.
pytestmark = pytest.mark.model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "models"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(root))
    return root


@pytest.fixture
def ckpt():
    return resolve_checkpoint("smollm2-135m")


def test_weights_from_the_converted_copy_equal_the_gguf(cache, ckpt):
    cfg, from_gguf = load_checkpoint(ckpt, torch.float32)  # miss: converts, writes
    part = model_cache.cached_part(ckpt.path, ckpt.model_id, "weights")
    assert part is not None
    cfg2, from_copy = load_checkpoint(ckpt, torch.float32)  # hit
    assert cfg2 == cfg
    assert from_copy.keys() == from_gguf.keys()
    assert all(torch.equal(from_copy[k], from_gguf[k]) for k in from_gguf)
    half = load_checkpoint(ckpt, torch.bfloat16)[1]  # any dtype converts from the float32 copy
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], from_gguf[k].bfloat16()) for k in from_gguf)

    # A copy truncated (a crash before the data reached the disk) is removed and rewritten.
    weights = part / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])
    cfg3, again = load_checkpoint(ckpt, torch.float32)
    assert cfg3 == cfg and all(torch.equal(again[k], from_gguf[k]) for k in from_gguf)
    assert (part / "model.safetensors").stat().st_size > 1 << 20


def test_tokenizer_from_the_converted_copy_tokenizes_as_the_gguf(cache, ckpt):
    from_gguf = Tokenizer(ckpt)  # miss
    assert model_cache.cached_part(ckpt.path, ckpt.model_id, "tokenizer") is not None
    from_copy = Tokenizer(ckpt)  # hit
    texts = ["Hello world!", "  spaces\n\ttabs", "émoji 😀 中文 ﬁ", "<|im_start|>user\nhi<|im_end|>", "def f(x): ..."]
    for text in texts:
        assert from_copy.encode(text) == from_gguf.encode(text)
        assert from_copy.encode(text, add_special_tokens=True) == from_gguf.encode(text, add_special_tokens=True)
    ids = list(range(0, from_gguf.vocab_size, 97)) + [0, 1, 2]
    for skip in (True, False):
        assert from_copy.decode(ids, skip_special_tokens=skip) == from_gguf.decode(ids, skip_special_tokens=skip)
    assert from_copy.convert_ids_to_tokens(ids) == from_gguf.convert_ids_to_tokens(ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert from_copy.apply_chat_template(messages) == from_gguf.apply_chat_template(messages)
    assert (from_copy.eos_token_id, from_copy.vocab_size) == (from_gguf.eos_token_id, from_gguf.vocab_size)


PROGRAM = """
import sys
from engine.tokenizer import Tokenizer
from engine.weights import resolve_checkpoint
tok = Tokenizer(resolve_checkpoint("smollm2-135m"))
assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!" and tok.eos_token_id is not None
assert tok.chat_template
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""


def test_the_converted_copy_tokenizes_without_transformers(cache, ckpt):
    # An engine core loads a tokenizer to detokenize; importing transformers would cost
    # it ~0.75 s of CPU at every start. Only a chat template or a grammar loads it.
    Tokenizer(ckpt)  # converts, with transformers, in this process
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, model_cache.CACHE_ENV: str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _write(text: str):
    def write(directory: Path) -> None:
        (directory / "part.txt").write_text(text)

    return write


def test_first_writer_wins_and_the_loser_leaves_nothing(cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    first = model_cache.store_part(src, "m", "weights", _write("first"))
    second = model_cache.store_part(src, "m", "weights", _write("second"))  # rename onto an existing part
    assert first == second and (first / "part.txt").read_text() == "first"
    assert [p.name for p in first.parent.iterdir()] == ["weights"]  # no temporary directory left


def test_an_edited_checkpoint_misses(cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    model_cache.store_part(src, "m", "weights", _write("old"))
    assert model_cache.cached_part(src, "m", "weights") is not None
    src.write_bytes(b"xy")
    assert model_cache.cached_part(src, "m", "weights") is None


def test_a_changed_conversion_misses(cache, tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    model_cache.store_part(src, "m", "weights", _write("old"))
    monkeypatch.setattr(model_cache, "_converter_fingerprint", lambda: "another conversion")
    assert model_cache.cached_part(src, "m", "weights") is None


def test_a_failing_writer_leaves_nothing_and_raises_nothing(cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")

    def fails(directory: Path) -> None:
        (directory / "half").write_text("x")
        raise ValueError("disk full")

    assert model_cache.store_part(src, "m", "weights", fails) is None
    entry = model_cache.entry_dir(src, "m")
    assert entry is not None and list(entry.iterdir()) == []


def test_temporary_parts_of_dead_writers_are_removed(cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    entry = model_cache.entry_dir(src, "m")
    assert entry is not None
    abandoned = entry / ".weights-dead"
    abandoned.mkdir(parents=True)
    old = abandoned.stat().st_mtime - 2 * model_cache._ABANDONED_S
    os.utime(abandoned, (old, old))
    model_cache.store_part(src, "m", "tokenizer", _write("x"))
    assert sorted(p.name for p in entry.iterdir()) == ["tokenizer"]


def test_writing_an_entry_removes_the_models_superseded_ones(cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    entry = model_cache.entry_dir(src, "m")
    assert entry is not None
    stale, recent, other_model = (cache / "m-0123456789abcdef", cache / "m-fedcba9876543210",
                                  cache / "m-v2-0123456789abcdef")
    for d in (stale, recent, other_model):
        (d / "weights").mkdir(parents=True)
    old = stale.stat().st_mtime - 2 * model_cache._ABANDONED_S
    for d in (stale, other_model):
        os.utime(d, (old, old))
    model_cache.store_part(src, "m", "weights", _write("x"))
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, recent.name, other_model.name])


def test_off_or_unwritable_cache_only_costs_the_conversion(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    monkeypatch.setenv(model_cache.CACHE_ENV, "off")
    assert model_cache.store_part(src, "m", "weights", _write("x")) is None
    assert model_cache.cached_part(src, "m", "weights") is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(model_cache.CACHE_ENV, os.fspath(blocker / "models"))  # below a file: unwritable
    assert model_cache.store_part(src, "m", "weights", _write("x")) is None
