"""A Llama-architecture checkpoint with random weights, in Hugging Face's layout.

No model can be downloaded on these machines, and the embedded SmolLM2 (a 98 MB GGUF)
is the only real checkpoint: this writes any Llama shape as a HF directory
(`config.json` in the hub's legacy form, sharded `*.safetensors` with an index, and a
byte-level tokenizer with a ChatML template) so that the HF loading path, a larger
model's memory and speed, and the CUDA path can be exercised against transformers.
The outputs are noise; the arithmetic is the real model's.

    python -m bench.random_checkpoint DIR [--shape llama-3.2-1b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rope_scaling: dict | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        layer = h * (2 * h + 2 * kv) + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_hidden_layers * layer + self.vocab_size * h + head + h


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, LlamaShape] = {
    # For tests: untied head, a non-default theta and llama3 scaling, so that a loader
    # that drops any of them produces different logits.
    "tiny": LlamaShape(64, 2, 4, 2, 128, 384, tie_word_embeddings=False, rope_theta=50000.0,
                       rope_scaling={**_LLAMA3_ROPE, "factor": 4.0, "original_max_position_embeddings": 512}),
    "smollm2-135m": LlamaShape(576, 30, 9, 3, 1536, 49152, rope_theta=100000.0, max_position_embeddings=8192),
    "llama-3.2-1b": LlamaShape(2048, 16, 32, 8, 8192, 128256, rope_theta=500000.0,
                               max_position_embeddings=8192, rope_scaling=_LLAMA3_ROPE),
    "llama-3.1-8b": LlamaShape(4096, 32, 32, 8, 14336, 128256, tie_word_embeddings=False, rope_theta=500000.0,
                               max_position_embeddings=8192, rope_scaling=_LLAMA3_ROPE),
}


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """Byte-level BPE over the 256 bytes and no merges (any text encodes), the ChatML
    specials, and filler tokens up to `vocab_size` so that every id the model can
    sample decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = special_id(tok)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab)} (bytes and specials)")
    for i in range(len(vocab), vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML)
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    fast.save_pretrained(directory)


def write_checkpoint(directory: str | os.PathLike, shape: LlamaShape, *, seed: int = 0, std: float = 0.02,
                     dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                     shard_bytes: int = 2 << 30) -> Path:
    """Write `shape` with N(0, std) linear and embedding weights (norms 1) into
    `directory`; returns it. Tensors are made on `device` (a GPU makes an 8B model in
    seconds) and written in shards of about `shard_bytes`."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, kv = shape.hidden_size, shape.head_dim, shape.num_key_value_heads
    q_out, kv_out = shape.num_attention_heads * d, kv * d

    def normal(*size: int) -> torch.Tensor:
        w = torch.empty(*size, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
        return w.to(dtype).cpu()

    def tensors():
        yield "model.embed_tokens.weight", normal(shape.vocab_size, h)
        for i in range(shape.num_hidden_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", torch.ones(h, dtype=dtype)
            yield p + "self_attn.q_proj.weight", normal(q_out, h)
            yield p + "self_attn.k_proj.weight", normal(kv_out, h)
            yield p + "self_attn.v_proj.weight", normal(kv_out, h)
            yield p + "self_attn.o_proj.weight", normal(h, q_out)
            yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=dtype)
            yield p + "mlp.gate_proj.weight", normal(shape.intermediate_size, h)
            yield p + "mlp.up_proj.weight", normal(shape.intermediate_size, h)
            yield p + "mlp.down_proj.weight", normal(h, shape.intermediate_size)
        yield "model.norm.weight", torch.ones(h, dtype=dtype)
        if not shape.tie_word_embeddings:
            yield "lm_head.weight", normal(shape.vocab_size, h)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors():
        if size and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.fspath(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.nbytes for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))

    config = {k: v for k, v in asdict(shape).items() if v is not None}
    config |= {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "head_dim": d,
        "rms_norm_eps": 1e-5, "bos_token_id": special_id("<|im_start|>"), "eos_token_id": special_id("<|im_end|>"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, shape.vocab_size)
    return out


def special_id(token: str) -> int:
    """The id `write_tokenizer` gives a special token: after the 256 byte tokens."""
    return 256 + SPECIAL_TOKENS.index(token)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.random_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="where the random tensors are made")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.layers:
        shape = replace(shape, num_hidden_layers=args.layers)
    out = write_checkpoint(args.directory, shape, seed=args.seed, dtype=getattr(torch, args.dtype),
                           device=args.device)
    print(f"wrote {args.shape} ({shape.num_params() / 1e9:.2f}B parameters, {args.dtype}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
