"""The ingress request router never loads torch, nor do the gateway's modules until a
replica builds its engine: importing them and loading the embedded model's tokenizer
leave torch unimported. torch would cost the router ~1.3 s of CPU at start and ~200 MB
of memory on every node that runs HAProxy."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import DEFAULT_MODEL
from engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit

PROGRAM = """
import sys
import routing.openai.gateway
import routing.router.ingress
from engine.config import DEFAULT_MODEL
from engine.tokenizer import load_tokenizer
assert load_tokenizer(DEFAULT_MODEL).encode("Hello")
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_a_gateway_and_its_tokenizer_load_without_torch():
    # The model cache's converted copy first (converting the GGUF's tokenizer takes
    # transformers' GGUF reader, and torch with it: once per machine and version).
    load_tokenizer(DEFAULT_MODEL)
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
