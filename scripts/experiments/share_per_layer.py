"""Does a shared-core engine gain from resizing its team between layers, not only
between steps (engine/core_share.py `threads_now`)?

Two engine processes share this machine's cores through one `CoreShare` table, as a
P/D pair's engine cores do with `engine.share_cores`, each allowed two threads:

- decode: a batch of `--batch` sequences decoding without end (restarted each phase,
  its first step, the prompts' prefill, not counted);
- prefill: every `--period` seconds, `--prompts` random prompts of `--prompt-len`
  tokens computed to their first token in one step, like a prefill replica's burst.

The parent alternates phases of `--phase` seconds, A B B A ..., with the between-
layers resize on or off in both processes, and prints each side's rate per phase:
one machine, one minute apart, so the drift of a KVM's neighbours falls on both.

    .venv/bin/python scripts/experiments/share_per_layer.py --pairs 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from pathlib import Path

from engine.sampling_params import SamplingParams


def _start(table: str, blocks: int, loaded):
    """A worker's engine (two threads, warmed up) and its slot in the table; tells the
    parent it is ready. Returns the engine, the slot, and the team sizing to call
    between layers (`follow`) and before each step (`busy`)."""
    import torch

    from engine.async_engine import warm_up
    from engine.config import EngineConfig
    from engine.core_share import CoreShare
    from engine.engine import Engine

    torch.set_num_threads(2)
    engine = Engine(EngineConfig(num_kv_blocks=blocks))
    warm_up(engine)
    cores = CoreShare(2, path=Path(table))

    def use(n: int) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def follow() -> None:  # between layers, as engine/core_process.py does
        use(cores.threads_now())

    def busy() -> None:  # before a step
        use(cores.busy())

    loaded.release()
    return engine, cores, follow, busy


def _decode(table: str, a: argparse.Namespace, phase, per_layer, loaded, ready, out) -> None:
    engine, cores, follow, busy = _start(table, a.batch * 64, loaded)
    rng = random.Random(1)
    sp = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    ready.wait()
    counts: dict[int, list[float]] = {}
    current, ids, began, tokens = -1, [], 0.0, 0
    while phase.value >= 0:
        if phase.value != current:  # a new phase: a fresh batch, its prefill step not counted
            for rid in ids:
                engine.abort(rid)
            current = phase.value
            engine.model.between_layers = follow if per_layer.value else None
            ids = [engine.add_request([rng.randrange(1000, 40000) for _ in range(a.prompt_len)], sp)
                   for _ in range(a.batch)]
            busy()
            engine.step()
            began, tokens = time.monotonic(), 0
        busy()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        counts[current] = [tokens, time.monotonic() - began]
    for rid in ids:
        engine.abort(rid)
    cores.close()
    out.put(("decode", counts))


def _prefill(table: str, a: argparse.Namespace, phase, per_layer, loaded, ready, out) -> None:
    engine, cores, follow, busy = _start(table, a.prompts * (a.prompt_len // 16 + 2) * 2, loaded)
    rng = random.Random(2)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ready.wait()
    counts: dict[int, list[float]] = {}
    while phase.value >= 0:
        current = phase.value
        engine.model.between_layers = follow if per_layer.value else None
        for _ in range(a.prompts):
            engine.add_request([rng.randrange(1000, 40000) for _ in range(a.prompt_len)], sp)
        began = time.monotonic()
        while engine.has_unfinished():
            busy()
            engine.step()
        cores.idle()
        c = counts.setdefault(current, [0, 0.0])
        c[0] += 1
        c[1] += time.monotonic() - began
        time.sleep(a.period)
    cores.close()
    out.put(("prefill", counts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--phase", type=float, default=15.0, help="seconds per phase")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--period", type=float, default=1.0, help="seconds between prefill bursts")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    phase, per_layer = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False)
    loaded, ready, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        table = str(Path(tmp) / "cores")
        shared = (table, a, phase, per_layer, loaded, ready, out)
        procs = [ctx.Process(target=f, args=shared) for f in (_decode, _prefill)]
        for proc in procs:
            proc.start()
        for _ in procs:  # both engines loaded and warmed up
            if not loaded.acquire(timeout=300):
                raise SystemExit("an engine did not load in 300 s")
        order = [on for pair in range(a.pairs) for on in ((1, 0) if pair % 2 == 0 else (0, 1))]
        per_layer.value = order[0]
        ready.set()
        for i, on in enumerate(order):
            per_layer.value, phase.value = on, i
            time.sleep(a.phase)
        phase.value = -1
        results = dict(out.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join(60)
    rows = []
    for i, on in enumerate(order):
        tokens, seconds = results["decode"].get(i, [0, 1.0])
        bursts, busy_s = results["prefill"].get(i, [0, 0.0])
        rows.append({"phase": i, "per_layer": bool(on), "decode_tok_s": tokens / seconds,
                     "prefill_bursts": bursts, "prefill_burst_ms": 1000 * busy_s / max(bursts, 1)})
        print(f"phase {i:2d} per_layer={'on ' if on else 'off'} decode {tokens / seconds:6.1f} tok/s, "
              f"{bursts} prefill bursts of {1000 * busy_s / max(bursts, 1):6.1f} ms")
    summary = {}
    for on in (True, False):
        side = [r for r in rows if r["per_layer"] == on]
        summary["on" if on else "off"] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in side),
            "prefill_burst_ms": statistics.median(r["prefill_burst_ms"] for r in side)}
    print(json.dumps(summary))
    if a.json:
        a.json.write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k != "json"},
                                      "rows": rows, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
