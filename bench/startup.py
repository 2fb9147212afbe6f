"""Replica start-up: what a new prefill/decode replica (or gateway) spends before it
can serve, with and without the converted model copy (engine/model_cache.py).

    duet bench startup [--runs 3] [--out bench_startup.json]

Each run is a fresh Python process, as a new replica is: it imports the engine, loads
the tokenizer (all a gateway loads), builds the engine (weights) and runs its warm-up
request (`start_engine`, what a replica's constructor does). Two ways, measured in the
same run: ``gguf`` (``DUET_MODEL_CACHE=off``: the GGUF parsed for the tokenizer and
again for the weights) and ``cached`` (a converted copy, written once before the
runs, in a temporary directory). A third child starts as a gateway replica does
(imports the gateway, loads the tokenizer from the converted copy) and reports its
CPU seconds, its peak memory and whether torch got loaded (it must not). Prints the
medians, writes JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from engine.model_cache import CACHE_ENV

# Runs in the child: phases in seconds, as one JSON line.
_CHILD = """
import json, time
t0 = time.perf_counter()
from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.tokenizer import load_tokenizer
t1 = time.perf_counter()
cfg = EngineConfig(model={model!r}, dtype="float32", device="cpu", num_kv_blocks=256)
load_tokenizer(cfg.model)
t2 = time.perf_counter()
engine = start_engine(cfg, "prefill", 1)
t3 = time.perf_counter()
engine.shutdown()
print(json.dumps({{"imports_s": t1 - t0, "tokenizer_s": t2 - t1, "engine_s": t3 - t2, "total_s": t3 - t0}}))
"""
PHASES = ("imports_s", "tokenizer_s", "engine_s", "total_s")

_GATEWAY = """
import json, resource, sys, time
t0 = time.perf_counter()
import routing.openai.gateway
from engine.tokenizer import load_tokenizer
t1 = time.perf_counter()
load_tokenizer({model!r})
t2 = time.perf_counter()
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"imports_s": t1 - t0, "tokenizer_s": t2 - t1, "total_s": t2 - t0,
                  "cpu_s": use.ru_utime + use.ru_stime, "max_rss_mb": use.ru_maxrss / 1024,
                  "torch_loaded": "torch" in sys.modules}}))
"""
GATEWAY_PHASES = ("imports_s", "tokenizer_s", "total_s", "cpu_s", "max_rss_mb")


def _child(model: str, cache: str, program: str = _CHILD) -> dict:
    env = {**os.environ, CACHE_ENV: cache}
    out = subprocess.run([sys.executable, "-c", program.format(model=model)], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="bench_startup.json")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="duet-model-cache-") as cache:
        _child(args.model, cache)  # writes the converted copy
        runs: dict[str, list[dict]] = {"gguf": [], "cached": []}
        gateway: list[dict] = []
        for _ in range(args.runs):  # interleaved: a drift of the machine hits both ways alike
            runs["gguf"].append(_child(args.model, "off"))
            runs["cached"].append(_child(args.model, cache))
            gateway.append(_child(args.model, cache, _GATEWAY))
    medians = {way: {ph: statistics.median(r[ph] for r in rs) for ph in PHASES} for way, rs in runs.items()}
    gateway_medians = {ph: statistics.median(r[ph] for r in gateway) for ph in GATEWAY_PHASES}
    print(f"replica start-up, {args.model}, median of {args.runs} fresh processes (seconds)")
    print(f"{'way':8} " + " ".join(f"{ph[:-2]:>10}" for ph in PHASES))
    for way, m in medians.items():
        print(f"{way:8} " + " ".join(f"{m[ph]:10.2f}" for ph in PHASES))
    phases = ", ".join(f"{ph} {gateway_medians[ph]:.2f}" for ph in GATEWAY_PHASES)
    print(f"a gateway replica (cached tokenizer): {phases}; torch loaded: {any(r['torch_loaded'] for r in gateway)}")
    report = {
        "model": args.model,
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                    "cores": os.cpu_count()},
        "medians": medians,
        "runs": runs,
        "gateway": {"medians": gateway_medians, "runs": gateway},
    }
    write_json(args.out, report)
    return 0
