"""`scripts/experiments/packing.py`: one decode step's matrix products on the model's own
shapes (every layer's fused QKV, output, gate/up and down projections, and the LM
head), fp32 on the CPU, with the weights as the engine keeps them plain (`x @ w`,
MKL) against packed once for oneDNN (engine/quant.py `PackedWeight`), at several row
counts. The weights are the real model's size, so they stream from memory as they do
in a step; their values are random (the speed does not depend on them).

Each figure is the best of `--repeats` passes over all the products, in ms per step.
`PACKED_MAX_ROWS` in engine/quant.py is set from this table.

    python scripts/experiments/packing.py [--threads 1] [--rows 1 2 8 32 256] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run as a script

import argparse
import platform
import time

import torch

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags, matmul_shapes
from engine.quant import PackedWeight
from engine.weights import load_checkpoint, resolve_checkpoint


def _shapes(model: str) -> list[tuple[int, int]]:
    """`[in, out]` of every linear product in one step, in order."""
    cfg, _ = load_checkpoint(resolve_checkpoint(model), torch.float32)
    return [(i, o) for i, o, count in matmul_shapes(cfg) for _ in range(count)]


def _step_ms(product, weights: list, shapes: list[tuple[int, int]], rows: int, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for k in {i for i, _ in shapes}}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for (k, _), w in zip(shapes, weights, strict=True):
            product(xs[k], w)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _packed(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    # The packed copy at every row count (on one thread, engine/quant.py keeps the plain
    # copy for one row and long chunks: this table is why).
    return w.packed_product(x)


def run(model: str, threads: int, rows: list[int], repeats: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    shapes = _shapes(model)
    plain = [torch.randn(i, o) * 0.02 for i, o in shapes]
    packed = [PackedWeight.pack(w, keep_dense=False) for w in plain]
    points = [{"rows": n, "plain_ms": round(_step_ms(_plain, plain, shapes, n, repeats), 1),
               "packed_ms": round(_step_ms(_packed, packed, shapes, n, repeats), 1)} for n in rows]
    return {"bench": "packing", "model": model, "threads": threads, "repeats": repeats,
            "weights_mb": round(sum(i * o for i, o in shapes) * 4 / 1e6),
            "machine": {"cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags()},
            "points": points}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/experiments/packing.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    result = run(args.model, args.threads, args.rows, args.repeats)
    print(f"{result['model']}: {result['weights_mb']} MB of fp32 linear weights, {args.threads} thread(s), "
          f"CPU flags: {result['machine']['cpu_flags']}; ms per step, best of {args.repeats}")
    print(f"{'rows':>5} {'plain (MKL)':>12} {'packed (oneDNN)':>16}")
    for pt in result["points"]:
        print(f"{pt['rows']:>5} {pt['plain_ms']:>12.1f} {pt['packed_ms']:>16.1f}")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
