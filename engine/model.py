"""Our Llama forward: RMSNorm, RoPE, grouped-query attention over the paged KV
cache, SwiGLU MLP, optionally tied LM head.

Weights arrive in HF naming from `weights.py`. Q/K/V and gate/up are fused into
one matmul each: on a CPU the fixed cost per op matters as much as the FLOPs.
Linear weights are stored transposed, `[in, out]`, and applied as `x @ w`: MKL's
fp32 GEMM runs up to 2x faster with a non-transposed B on the decode shapes
(docs/benchmarks.md). On a CPU in fp32 each is also pre-packed for oneDNN, which
products of several rows use, and on two threads or more all of them
(engine/quant.py `PackedWeight`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.quant import Linear, PackedWeight, WeightQuant, keeps_dense_copy, matmul, maybe_quantize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's LlamaRMSNorm (variance in fp32, cast back, then scale).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    import math

    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Owns the weights (fused, in the engine's dtype and device) and runs one step."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                 weight_quant: WeightQuant = "none", packed_weights: bool = False):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device

        def take(name: str) -> torch.Tensor:
            return state.pop(name).to(device=device, dtype=dtype).contiguous()

        # The products run on torch's intra-op threads, set before the model loads.
        keep_dense = keeps_dense_copy(torch.get_num_threads())

        def linear(w_out_in: torch.Tensor) -> Linear:  # plain [in, out], int8 or packed: engine/quant.py
            if packed_weights:
                return PackedWeight.pack_out_in(w_out_in, keep_dense)
            return maybe_quantize(w_out_in.t().contiguous(), weight_quant, dtype)

        def take_t(*names: str) -> Linear:  # fused along `out`, as the checkpoint stores them: [out, in]
            parts = [state.pop(n) for n in names]
            fused = torch.cat(parts) if len(parts) > 1 else parts[0]  # cat copies even one tensor
            return linear(fused.to(device=device, dtype=dtype))

        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                (
                    take(p + "input_layernorm.weight"),
                    take_t(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    take_t(p + "self_attn.o_proj.weight"),
                    take(p + "post_attention_layernorm.weight"),
                    take_t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    take_t(p + "mlp.down_proj.weight"),
                )
            )
        self.norm = take("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = linear(self.embed)  # [vocab, hidden]: [out, in]; the product makes its own copy
        else:
            self.lm_head = take_t("lm_head.weight")
        # cos/sin for every position, computed once (fp32 math, as HF, then cast).
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(device=device, dtype=dtype)
        self.rope_sin = emb.sin().to(device=device, dtype=dtype)
        self.scale = cfg.head_dim**-0.5
        # Called before every layer but the first: an engine core that shares its
        # machine's cores resizes its thread team there (engine/core_share.py).
        self.between_layers: Callable[[], None] | None = None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,  # [R] rows whose next-token logits are needed
    ) -> torch.Tensor:
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(positions)
        t = input_ids.shape[0]
        between_layers = self.between_layers
        for i, (weights, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            if between_layers is not None and i:
                between_layers()
            ln1, w_qkv, w_o, ln2, w_gate_up, w_down = weights
            x = rms_norm(h, ln1, cfg.rms_norm_eps)
            qkv = matmul(x, w_qkv)
            # RoPE on Q and K together: they are adjacent in the fused projection.
            qk = qkv[:, : self.q_size + self.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h = h + matmul(attn, w_o)
            x = rms_norm(h, ln2, cfg.rms_norm_eps)
            gate, up = matmul(x, w_gate_up).chunk(2, dim=-1)
            h = h + matmul(F.silu(gate) * up, w_down)
        h = rms_norm(h[logits_indices], self.norm, cfg.rms_norm_eps)
        return matmul(h, self.lm_head).float()
