"""Tokenizer and chat template, from the GGUF metadata or a Hugging Face directory.

transformers rebuilds the GGUF's GPT-2 BPE as a fast (Rust) tokenizer, so the
gateway and the engine tokenize exactly as the reference implementation does. Its
saved copy is read back with the `tokenizers` library alone (`SavedTokenizer`):
encoding and decoding are that library's either way, and importing transformers costs
~0.75 s of CPU, which every engine core paid at start for a chat template it never
renders. transformers is loaded when a process first renders a chat template or
compiles a grammar.
"""

from __future__ import annotations

import json
import os
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, cast

from engine import model_cache
from engine.weights import Checkpoint, resolve_checkpoint


class Tokenizer:
    """Owns encode/decode, the special ids and the chat template of one model."""

    def __init__(self, ckpt: Checkpoint):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # A SavedTokenizer (the GGUF's converted copy) or a transformers tokenizer.
        self._backend: Any
        if ckpt.kind == "gguf":
            self._backend = _gguf_tokenizer(ckpt)
        else:
            from transformers import AutoTokenizer

            self._backend = AutoTokenizer.from_pretrained(str(ckpt.path))
        self.eos_token_id: int | None = self._backend.eos_token_id
        self.vocab_size = len(self._backend)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (llguidance and chat templates take one); a saved
        copy builds it the first time it is asked for."""
        return self._backend.hf if isinstance(self._backend, SavedTokenizer) else self._backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return cast(list[str], self._backend.convert_ids_to_tokens(token_ids))

    @property
    def chat_template(self) -> str | None:
        return cast("str | None", self._backend.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template: str | None = None) -> str:
        """`tools`: for a template that renders them itself (routing/openai/tools.py);
        `template`: used instead of the checkpoint's (`gateway.chat_template`)."""
        if not (template or self.chat_template):
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


def _read_converted(directory: Path) -> SavedTokenizer:
    return SavedTokenizer(directory)


class SavedTokenizer:
    """A saved fast tokenizer (`tokenizer.json`, `tokenizer_config.json`, the chat
    template) read with the `tokenizers` library: the subset of a transformers tokenizer
    that `Tokenizer` uses, without importing transformers (~0.75 s of CPU per process).
    `hf` builds the transformers tokenizer from the same files when a caller needs one
    (`PreTrainedTokenizerFast`, not `AutoTokenizer`, which would import torch too)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self.directory = directory
        self._fast = FastTokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        # transformers' decode also cleans spaces before punctuation when this is set;
        # such a tokenizer decodes through transformers, to stay exactly as it does.
        self._decode_through_hf = bool(config.get("clean_up_tokenization_spaces", False))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id: int | None = self._fast.token_to_id(eos) if isinstance(eos, str) else None
        if eos is not None and self.eos_token_id is None:
            self.eos_token_id = self.hf.eos_token_id  # defined some other way: ask transformers
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        # A list of named templates is transformers' to choose from.
        self.chat_template: str | None = template if isinstance(template, str) or template is None \
            else self.hf.chat_template

    @cached_property
    def hf(self) -> Any:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(self.directory))

    def __len__(self) -> int:
        return int(self._fast.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._fast.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._decode_through_hf:
            return cast(str, self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return cast(str, self._fast.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [cast(str, self._fast.id_to_token(i)) for i in token_ids]

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf.apply_chat_template(*args, **kwargs)


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
        ids = hf.encode(text)
        for skip in (False, True):
            if copy.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                raise ValueError(f"the saved tokenizer decodes {text!r} differently")
    if copy.eos_token_id != hf.eos_token_id:
        raise ValueError("the saved tokenizer's end-of-sequence token differs")
    if copy.chat_template != hf.chat_template or len(copy) != len(hf):
        raise ValueError("the saved tokenizer's chat template or vocabulary differs")


@lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Tokenizer:
    return Tokenizer(resolve_checkpoint(model))
