"""Tokenizer and chat template, from the GGUF metadata or a Hugging Face directory.

transformers rebuilds the GGUF's GPT-2 BPE as a fast (Rust) tokenizer, so the
gateway and the engine tokenize exactly as the reference implementation does.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import cast

from engine import model_cache
from engine.weights import Checkpoint, resolve_checkpoint


class Tokenizer:
    """Owns encode/decode, the special ids and the chat template of one model."""

    def __init__(self, ckpt: Checkpoint):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if ckpt.kind == "gguf":
            self.hf = _gguf_tokenizer(ckpt)
        else:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(str(ckpt.path))
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return cast(list[str], self.hf.convert_ids_to_tokens(token_ids))

    @property
    def chat_template(self) -> str | None:
        return cast("str | None", self.hf.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template: str | None = None) -> str:
        """`tools`: for a template that renders them itself (routing/openai/tools.py);
        `template`: used instead of the checkpoint's (`gateway.chat_template`)."""
        if not (template or self.hf.chat_template):
            raise ValueError("this model has no chat template; use the completions endpoint")
        text = self.hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        return cast(str, text)


def _gguf_tokenizer(ckpt: Checkpoint):
    """From the converted copy (engine/model_cache.py) when there is one: rebuilding it
    from the GGUF's metadata takes ~5 s, reading the saved one ~0.2 s."""
    return model_cache.load_or_convert(
        ckpt.path, ckpt.model_id, "tokenizer", _read_converted, lambda: _convert(ckpt), _save_checked)


def _convert(ckpt: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name)


def _read_converted(directory: Path):
    """The saved copy is a `tokenizer.json` (a fast tokenizer), read by its class.
    `AutoTokenizer` would import transformers' model configs and, through them, torch:
    ~1.7 s more per process, and a gateway needs no torch at all."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


# Text whose ids must not change between the GGUF's tokenizer and its saved copy:
# pre-tokenizer splits, byte fallback, special tokens.
_PROBES = ("Hello, world!", " two  spaces\tand a tab\n", "émoji 😀 中文 ﬁ", "<|im_start|>user\nhi<|im_end|>")


def _save_checked(hf, directory: Path) -> None:
    """Save `hf` and read it back as later starts will; a copy that tokenizes or
    templates differently is refused (the model cache then keeps nothing and later
    starts convert again)."""
    hf.save_pretrained(directory)
    copy = _read_converted(directory)
    for text in _PROBES:
        if copy.encode(text) != hf.encode(text):
            raise ValueError(f"the saved tokenizer encodes {text!r} differently")
    if copy.chat_template != hf.chat_template or len(copy) != len(hf):
        raise ValueError("the saved tokenizer's chat template or vocabulary differs")


@lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Tokenizer:
    return Tokenizer(resolve_checkpoint(model))
