"""Experiment (docs/benchmarks.md, "The engine on a GPU"): what CUDA graphs would give
the decode step on a GPU. Not built into the engine.

For a random-weight checkpoint of a real shape (bench/random_checkpoint.py), one decode
step of `LlamaModel.forward` at batch B, every sequence `--context` tokens long:
- **eager**: the forward as the engine runs it on CUDA today (kernel by kernel from
  Python), given ready metadata; the host-side metadata build is timed apart;
- **graph**: the same forward captured once as a CUDA graph (block tables padded to a
  fixed width, so every shape is static) and replayed.
It checks that the replayed logits equal the eager ones, then prints ms per step.

    python scripts/experiments/cuda_graph_decode.py --shape llama-3.1-8b --batches 1 8 32
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from bench.random_checkpoint import SHAPES, write_checkpoint  # noqa: E402
from engine.attention import AttentionMetadata, build_decode_mask  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402


def timed_ms(fn, repeats: int) -> float:
    """Median ms of `fn` over `repeats` calls, each synchronised."""
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def measure(engine: Engine, batch: int, context: int, repeats: int) -> dict:
    """One batch size: eager against graph replay, and the host metadata build."""
    model, layers, bs = engine.model, engine.kv_cache.layers, engine.cfg.block_size
    dev = "cuda"
    width = context // bs + 1  # blocks per sequence, fixed: the graph's shapes never change
    tables = (torch.arange(batch * width, device=dev) + 1).view(batch, width)  # block 0 stays unused
    positions = torch.full((batch,), context - 1, dtype=torch.long, device=dev)
    input_ids = torch.randint(0, engine.model_config.vocab_size, (batch,), device=dev)
    meta = AttentionMetadata(
        slot_blocks=tables[:, (context - 1) // bs].contiguous(), slot_offsets=positions % bs,
        num_decode_tokens=batch, decode_block_tables=tables,
        decode_mask=build_decode_mask(positions + 1, width * bs, torch.float32), prefills=[],
    )
    rows_idx = torch.arange(batch, device=dev)

    def step():
        return model.forward(input_ids, positions, meta, layers, rows_idx)

    def host_metadata():  # what ModelRunner.prepare builds from Python lists each step
        t = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(batch)]
        torch.tensor(t, dtype=torch.long, device=dev)
        torch.tensor([context - 1] * batch, dtype=torch.long, device=dev)
        torch.tensor([0] * batch, dtype=torch.long, device=dev)
        build_decode_mask(torch.tensor([context] * batch, device=dev), width * bs, torch.float32)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    eager_logits = step().clone()
    graph.replay()
    torch.cuda.synchronize()
    row = {"batch": batch, "logits_equal": torch.equal(captured, eager_logits),
           "max_abs_diff": (captured.float() - eager_logits.float()).abs().max().item(),
           "eager_ms": timed_ms(step, repeats), "graph_ms": timed_ms(graph.replay, repeats),
           "host_metadata_ms": timed_ms(host_metadata, repeats)}
    row["speedup"] = row["eager_ms"] / row["graph_ms"]
    del graph, captured
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_checkpoint(d, SHAPES[a.shape], device="cuda")
        engine = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", max_num_seqs=max(a.batches)))
    rows = []
    for batch in a.batches:
        r = measure(engine, batch, a.context, a.repeats)
        rows.append(r)
        print(f"{a.shape} batch {batch:3d}: eager {r['eager_ms']:7.2f} ms  graph {r['graph_ms']:7.2f} ms "
              f"({r['speedup']:4.1f}x)  host metadata {r['host_metadata_ms']:5.2f} ms  "
              f"logits equal {r['logits_equal']} (max diff {r['max_abs_diff']:.2e})", flush=True)
    result = {"shape": a.shape, "context": a.context, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "repeats": a.repeats, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
