"""`scripts/experiments/profile.py`: where one engine decode step's time goes.

    python scripts/experiments/profile.py [--dtype float32] [--threads 2] [--batches 1 32] [--steps 16]
                       [--prompt-len 32] [--decode-attention auto|native|torch] [--json PATH]

For each batch size: that many sequences are prefilled and decoded to a steady state,
then `steps` decode steps are timed without a profiler (the step time), and again
under `torch.profiler`. For the profiled steps this tool wraps three engine functions
in `record_function` scopes, in its own process only (the engine carries no
profiling code): the model's forward, its paged attention, and the engine's sampling.
Each op's own time goes to the innermost scope it ran in:

- matmul: the weight matmuls (`mm`/`addmm`, oneDNN's packed linear, the int8 kernel;
  in the forward, outside attention);
- attention: everything inside paged attention (the paged-KV gather and layout,
  the score and value matmuls, softmax, masking);
- element-wise: the rest of the forward (norms, RoPE, SiLU, residuals, embedding);
- sampling: logits to tokens;
- other ops: the rest (building the step's input tensors).

What the ops do not account for in the profiled step is Python: scheduling, input
building, bookkeeping and per-op dispatch. The profiler's own overhead lands there
too, so its share is an upper bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run as a script

import argparse
import functools
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.engine import bench_prompts
from bench.json_output import write_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

# The weight products in each form they take: plain, oneDNN-packed (fp32 on a CPU) and int8.
MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "mkldnn::_linear_pointwise",
           "aten::_weight_int8pack_mm"}
WARM_STEPS = 6
CATEGORIES = ("matmul", "attention", "element-wise", "sampling", "other ops", "python and dispatch")


SCOPES = {"duet.attention": "attention", "duet.sampling": "sampling", "duet.forward": "element-wise"}


def _scope(evt) -> str | None:
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name in SCOPES:
            return SCOPES[parent.name]
        parent = parent.cpu_parent
    return None


def _category(evt) -> str:
    scope = _scope(evt)
    if scope == "element-wise" and evt.name in MATMULS:
        return "matmul"
    return scope or "other ops"


def _annotate(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(owner, name, scoped)


def _annotate_engine() -> None:
    import engine.engine
    import engine.model

    _annotate(engine.model, "paged_attention", "duet.attention")
    _annotate(engine.model.LlamaModel, "forward", "duet.forward")
    _annotate(engine.engine.Engine, "_sample", "duet.sampling")


def profile_batch(engine: Engine, batch: int, steps: int, prompt_len: int = 32) -> dict:
    # The prompts' prefill takes ceil(batch * prompt_len / token budget) steps; then a
    # few decode steps at the full batch before anything is timed.
    prefill_steps = -(-batch * prompt_len // engine.cfg.max_num_batched_tokens)
    sp = SamplingParams(max_tokens=WARM_STEPS + 2 * steps + 8, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in bench_prompts(engine, batch, prompt_len)]
    for _ in range(prefill_steps + WARM_STEPS):
        engine.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_s = (time.perf_counter() - t0) / steps
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    ms: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CPU and not evt.is_user_annotation:
            ms[_category(evt)] += evt.self_cpu_time_total / 1e3 / steps
    ops_ms = sum(ms.values())
    ms["python and dispatch"] = max(0.0, profiled_s * 1e3 - ops_ms)
    return {
        "batch": batch,
        "step_ms": statistics.median(walls) * 1e3,
        "profiled_step_ms": profiled_s * 1e3,
        "ms": {c: round(ms.get(c, 0.0), 3) for c in CATEGORIES},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/experiments/profile.py", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, help="context of the profiled steps starts here")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "native", "torch"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(dtype=args.dtype, device="cpu", decode_attention=args.decode_attention))
    backend = "native" if engine.runner.decode_kernel is not None else "torch"
    _annotate_engine()
    rows = [profile_batch(engine, b, args.steps, args.prompt_len) for b in args.batches]
    print(f"one decode step, {args.dtype}, {args.threads} threads, {backend} decode attention, prompt "
          f"{args.prompt_len}, ms (median step unprofiled; the split from the profiled steps)")
    print(f"{'batch':>6}{'step':>8}{'profiled':>10}" + "".join(f"{c[:12]:>14}" for c in CATEGORIES))
    for r in rows:
        print(f"{r['batch']:>6}{r['step_ms']:>8.1f}{r['profiled_step_ms']:>10.1f}"
              + "".join(f"{r['ms'][c]:>14.1f}" for c in CATEGORIES))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = {"dtype": args.dtype, "threads": args.threads, "decode_attention": backend,
                  "prompt_len": args.prompt_len, "rows": rows}
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
