"""Experiment (docs/benchmarks.md, "What we tried"): torch.compile (Inductor CPU)
of the dense halves of each layer, against the eager forward, in one process.

    .venv/bin/python scripts/experiments/compile_layers.py float32|bfloat16

Prints the cold compile time, then eager vs compiled output tok/s (median of 3,
alternated) at batch 1, 8 and 32, and how many greedy outputs stayed equal. It
rebuilds the layer loop of engine/model.py around two compiled functions; the paged
attention stays eager between them.
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.engine import bench_prompts  # noqa: E402
from engine import model as M  # noqa: E402
from engine.attention import paged_attention  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

dtype = sys.argv[1]
torch.set_num_threads(2)
eng = Engine(EngineConfig(dtype=dtype, num_kv_blocks=1024))
eng.block_pool.enable_caching = False
m = eng.model
cfg = m.cfg

def pre_attn(h, ln1, w_qkv, cos, sin):
    t = h.shape[0]
    x = M.rms_norm(h, ln1, cfg.rms_norm_eps)
    qkv = x @ w_qkv
    qk = qkv[:, : m.q_size + m.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    qk = qk * cos + M.rotate_half(qk) * sin
    q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
    v = qkv[:, m.q_size + m.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v

def post_attn(h, attn, w_o, ln2, w_gate_up, w_down):
    h = h + attn @ w_o
    x = M.rms_norm(h, ln2, cfg.rms_norm_eps)
    gate, up = (x @ w_gate_up).chunk(2, dim=-1)
    return h + (F.silu(gate) * up) @ w_down

mode = os.environ.get("MODE", "default")
cpre = torch.compile(pre_attn, dynamic=True, mode=None if mode == "default" else mode)
cpost = torch.compile(post_attn, dynamic=True, mode=None if mode == "default" else mode)

def forward(input_ids, positions, meta, kv_layers, logits_indices, pre=pre_attn, post=post_attn):
    with torch.inference_mode():
        h = F.embedding(input_ids, m.embed)
        cos, sin = m.rope(positions)
        for (ln1, w_qkv, w_o, ln2, w_gate_up, w_down), (k_cache, v_cache) in zip(m.layers, kv_layers):
            q, k, v = pre(h, ln1, w_qkv, cos, sin)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, m.scale)
            h = post(h, attn, w_o, ln2, w_gate_up, w_down)
        h = M.rms_norm(h[logits_indices], m.norm, cfg.rms_norm_eps)
        return (h @ m.lm_head).float()

eager_forward = m.forward
sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
def run(b):
    prompts = bench_prompts(eng, b, 32)
    t = time.perf_counter()
    out = eng.generate(prompts, sp)
    return b * 64 / (time.perf_counter() - t), [r.token_ids for r in out]

t0 = time.perf_counter()
m.forward = lambda *a: forward(*a, pre=cpre, post=cpost)
run(1)
run(32)
run(8)
print(f"{dtype}: compile + first runs {time.perf_counter() - t0:.1f} s", flush=True)
for b in (1, 8, 32):
    res = {"eager": [], "compiled": []}
    toks = {}
    for _ in range(3):
        for name, f in (("eager", eager_forward), ("compiled", lambda *a: forward(*a, pre=cpre, post=cpost))):
            m.forward = f
            r, toks[name] = run(b)
            res[name].append(r)
    same = sum(a == c for a, c in zip(toks["eager"], toks["compiled"]))
    e, c = statistics.median(res["eager"]), statistics.median(res["compiled"])
    print(f"{dtype} b{b}: eager {e:.1f} compiled {c:.1f} tok/s x{c/e:.2f} same {same}/{b}", flush=True)
