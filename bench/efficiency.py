"""`duet bench efficiency`: how much of the engine's speed `duet serve` keeps.

For each closed-loop concurrency (1, 8, 32 by default) the same prompts and forced
output lengths run three ways, one after another on the same cores:

1. **in-process**: an `Engine` driven directly, `concurrency` requests in flight
   (a new one added the moment one finishes), no HTTP, no Ray;
2. **aggregated**: `duet serve --mode aggregated`, driven by `duet bench serve`
   (loadgen, streaming completions, in its own process) over HTTP;
3. **disaggregated**: 1 prefill + 1 decode replica, driven the same way.

Efficiency is a mode's output tokens/s over the in-process figure at the same
concurrency. Beside them the run records the CPU's flags and this machine's ceilings
measured in the same run (bench/machine_ceilings.py: memory read GB/s and GEMM GFLOP/s
on the model's shapes), and the decode ceiling they give at each concurrency, so a
figure from one day's CPU can be read against what that CPU could do.

Each way gets its best layout on this machine: the in-process engine `--threads`
(2 on 2 cores); the aggregated mode `--served-replicas` (1) replica of
`--served-threads` (2), its engine core in a child process (`--engine-thread` puts it
back on a thread of the replica: with a second OpenMP thread it then lost ~20% to the
replica's event loop, and two one-thread replicas did no better; docs/benchmarks.md),
and the gateway inside that replica (the one topology; before it, a gateway replica of
its own relayed every token over Ray: 54% against 69% of in-process at c=32), with
HAProxy in front (`gateway.ingress: haproxy`: each connection goes to
the replica's own HTTP server; `--ingress proxy` puts Serve's Python proxy back, which
relays every chunk over Ray); the disaggregated mode 1 prefill + 1 decode replica
whose engines lend each other idle cores (`engine.share_cores`), each with a team of
up to `--prefill-threads` and `--decode-threads` (2 and 2;
`--no-share-cores --prefill-threads 1 --decode-threads 1` was the pools' default until 2026-12-08, a
core each, which left the decode engine on one thread while prefill's core idled:
57-78% of aggregated against 79-118%, three rounds each), both engines in a child process
(`--engine-thread` puts them back on a thread), the gateway inside the decode replica.
With one replica per pool there is nothing to choose: both modes serve with
`router.policy: default`, so no KV-aware router hashes prompts and HAProxy asks no
ingress request router (2-3 ms of TTFT).

The prompts are loadgen's `random` workload (its seed per point), so the engine
and the servers see the same words; each point has its own seed, so no point is
served from an earlier point's prefix cache.

These machines' speed drifts by a quarter within minutes (a neighbour's memory
traffic), more than the gaps between the modes. `--rounds N` runs the in-process
engine and serves the modes N times in alternating order (A B C, C B A, ...), each
served round on a fresh cluster: the rows are medians, and each round's
aggregated/in-process and disaggregated/aggregated ratios, taken minutes apart, are
printed beside them. `--step-trace` has every served engine trace its steps
(engine/step_trace.py): how busy each engine was at each point, on which team sizes,
and its output rate with the batch full, free of the ramp at a point's start (a
closed loop starts all its requests at once) and the tail at its end.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.json_output import write_json
from bench.loadgen_subprocess import run_loadgen, summarize
from bench.machine_ceilings import cpu_flags, measure
from cluster import serve_cli
from cluster.config import ClusterConfig, load_config
from engine import step_trace
from engine.engine import Engine
from engine.sampling_params import SamplingParams

MODES = ("aggregated", "disaggregated")


def point_prompts(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[str]:
    """The prompt texts `duet bench serve --seed seed` sends for this workload."""
    from loadgen.cli import parse_length
    from loadgen.prompts import PromptBuilder
    from loadgen.tokenizer import load_tokenizer
    from loadgen.workloads import WorkloadSpec, build_sessions

    spec = WorkloadSpec(kind="random", num_prompts=num_prompts, input_len=parse_length(str(input_len)),
                        output_len=parse_length(str(output_len)), seed=seed, ignore_eos=True)
    sessions = build_sessions(spec, PromptBuilder(load_tokenizer()), 0)
    return [turn.prompt for s in sessions for turn in s.turns]


def closed_loop(engine: Engine, prompts: list[str], output_len: int, concurrency: int) -> dict:
    """Run `prompts` through `engine` with `concurrency` in flight; loadgen's figures."""
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    todo = list(reversed(prompts))
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    ttft, tpot, out_tokens = [], [], 0
    t0 = time.perf_counter()
    while todo or started:
        while todo and len(started) < concurrency:
            started[engine.add_request(todo.pop(), sp)] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            out_tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                begin = started.pop(out.request_id)
                t_first = first.pop(out.request_id, now)
                ttft.append(1000 * (t_first - begin))
                tpot.append(1000 * (now - t_first) / max(output_len - 1, 1))
    wall = time.perf_counter() - t0
    return {"completed": len(prompts), "failed": 0,
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": statistics.median(tpot), "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "output_tok_s": out_tokens / wall}


def in_process(points: list[tuple[int, list[str]]], warmup: list[str], output_len: int, threads: int,
               dtype: str, ceilings_too: bool = True) -> tuple[list[dict], dict]:
    """The in-process rows, and (`ceilings_too`) the machine's ceilings measured at the
    engine's threads and dtype (an accelerator has none measured here)."""
    torch.set_num_threads(threads)
    cfg = load_config(overrides={"engine.dtype": dtype}).engine
    engine = Engine(cfg)
    ceilings: dict = {}
    if engine.device == "cpu" and ceilings_too:
        measured = measure(engine.model_config, engine.dtype, [c for c, _ in points], cfg.weight_quant)
        ceilings = {**measured.as_dict(),
                    "decode_tok_s": {str(c): measured.decode_tok_s(c) for c, _ in points}}
        print(f"  ceilings: read {measured.read_gbps:.1f} GB/s; decode tok/s bound "
              f"{', '.join(f'c={c}: {v:.0f}' for c, v in ceilings['decode_tok_s'].items())}", flush=True)
    closed_loop(engine, warmup, 4, len(warmup))  # as loadgen's --warmup: prompts no point sends
    rows = []
    for conc, prompts in points:
        rows.append(dict(closed_loop(engine, prompts, output_len, conc), concurrency=conc))
        print(f"  in-process c={conc}: {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
    return rows, ceilings


@dataclass(frozen=True)
class Layout:
    """How the servers are laid out on the machine (the module docstring says why)."""

    dtype: str = "auto"
    port: int = 8071
    stream_interval: int = 1
    aggregated_threads: int = 2
    aggregated_replicas: int = 1
    pd_threads: tuple[int, int] = (2, 2)  # prefill, decode: teams of up to two, cores shared
    engine_process: bool = True  # every pool's engine core in a child process
    share_cores: bool = True  # the engine cores lend each other idle cores (engine.share_cores)
    ingress: str = "haproxy"

    def config(self, mode: str) -> ClusterConfig:
        overrides = {"mode": mode, "gateway.port": self.port, "engine.dtype": self.dtype,
                     "engine.stream_interval": self.stream_interval, "gateway.ingress": self.ingress,
                     "engine.share_cores": self.share_cores}
        if mode == "disaggregated" or self.aggregated_replicas == 1:
            # One replica per pool: nothing to choose, so no KV-aware routers and no
            # ingress request router hop (routing/router/ingress.py).
            overrides["router.policy"] = "default"
        cfg = load_config(overrides=overrides)
        if mode == "aggregated":  # both pools' CPU reservation, shared
            cfg.aggregated.threads = self.aggregated_threads
            cfg.aggregated.replicas = self.aggregated_replicas
            cfg.aggregated.num_cpus = (cfg.prefill.num_cpus + cfg.decode.num_cpus) / self.aggregated_replicas
            cfg.aggregated.engine_process = self.engine_process
        else:
            cfg.prefill.threads, cfg.decode.threads = self.pd_threads
            cfg.prefill.engine_process = cfg.decode.engine_process = self.engine_process
        return cfg


def served(mode: str, points: list[tuple[int, list[str]]], seeds: list[int], input_len: int, output_len: int,
           layout: Layout, trace: Path | None = None) -> list[dict]:
    """The mode's rows; with `trace` (the engines' `DUET_STEP_TRACE` folder) each row
    also has its engines' steps during the point (`engines`, by trace file)."""
    url = serve_cli.start(layout.config(mode))
    rows = []
    try:
        for (conc, prompts), seed in zip(points, seeds):
            began = time.monotonic()
            with tempfile.TemporaryDirectory() as d:
                point = run_loadgen(url, Path(d), [
                    "--concurrency", str(conc), "--num-prompts", str(len(prompts)), "--seed", str(seed),
                    "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos",
                    "--warmup", "2"])[0]
            rows.append(dict(summarize(point), concurrency=conc))
            if trace is not None:
                full = conc - conc // 8  # a batch this full is steady: one finished, its successor not in yet
                ended = time.monotonic()
                engines = {name: step_trace.summarize(records, began, ended, full)
                           for name, records in step_trace.read(trace).items()}
                rows[-1]["engines"] = {name: e for name, e in engines.items() if e["steps"]}
            print(f"  {mode} c={conc}: {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
    finally:
        serve_cli.stop()
    return rows


def table(result: dict) -> str:
    base = {r["concurrency"]: r for r in result["in_process"]}
    bound = result.get("ceilings", {}).get("decode_tok_s", {})
    lines = ["| way | conc | out tok/s | of in-process | of decode ceiling | TTFT p50 ms | TPOT p50 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for way in ("in_process", *MODES):
        for r in result.get(way, []):
            eff = r["output_tok_s"] / base[r["concurrency"]]["output_tok_s"]
            ceiling = bound.get(str(r["concurrency"]))
            of_ceiling = f"{r['output_tok_s'] / ceiling:.0%}" if ceiling else "-"
            lines.append(f"| {way} | {r['concurrency']} | {r['output_tok_s']:.1f} | {eff:.0%} | {of_ceiling} | "
                         f"{r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.1f} |")
    agg = {r["concurrency"]: r for r in result.get("aggregated", [])}
    dis = {r["concurrency"]: r for r in result.get("disaggregated", [])}
    rounds = result.get("rounds", [])
    for c in sorted(set(agg) & set(dis)):
        lines.append(f"\nc={c}: disaggregated/aggregated throughput "
                     f"{dis[c]['output_tok_s'] / agg[c]['output_tok_s']:.0%}, TTFT p50 "
                     f"{dis[c]['ttft_p50_ms'] - agg[c]['ttft_p50_ms']:+.0f} ms")
    if len(rounds) > 1:  # each round's ways ran minutes apart: the ratios that drift moves least
        lines.append(f"\nThe rows are medians of {len(rounds)} rounds; each round's own ratios:")
        for way, of in (("aggregated", "in_process"), ("disaggregated", "aggregated")):
            for c in sorted({r["concurrency"] for r in result.get(way, [])}):
                if all(way in rd and of in rd for rd in rounds):
                    ratios = [_row(rd, way, c)["output_tok_s"] / _row(rd, of, c)["output_tok_s"] for rd in rounds]
                    lines.append(f"c={c}: {way}/{of} by round {', '.join(f'{x:.0%}' for x in ratios)}, "
                                 f"median {statistics.median(ratios):.0%}")
    lines += steady_lines(rounds)
    return "\n".join(lines)


def _row(round_: dict, mode: str, concurrency: int) -> dict:
    return next(r for r in round_[mode] if r["concurrency"] == concurrency)


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One mode's rows over its rounds: each figure the median of that point's rounds."""
    rows = []
    for points in zip(*rounds):
        row = {k: v for k, v in points[0].items() if k != "engines"}
        for key, value in row.items():
            if isinstance(value, float):
                row[key] = statistics.median(p[key] for p in points)
        rows.append(row)
    return rows


def steady_lines(rounds: list[dict]) -> list[str]:
    """With step traces: each round's served points' engines, and the decoding engine's
    output rate with its batch full (the steady state), against the client's figure."""
    lines = []
    for number, round_ in enumerate(rounds, 1):
        steady: dict[tuple[str, int], float] = {}
        label = f"round {number}: " if len(rounds) > 1 else ""
        for mode in MODES:
            for r in round_.get(mode, []):
                for name, e in r.get("engines", {}).items():
                    line = (f"{label}{mode} c={r['concurrency']} {name}: busy {e['busy']:.0%}, steps by team size "
                            f"{e['threads']}, step p50 {e['step_ms_p50']:.1f} ms")
                    if "steady" in e and step_trace.role_of(name) != "prefill":
                        st = e["steady"]
                        steady[(mode, r["concurrency"])] = st["outputs_per_s"]
                        line += (f"; steady {st['seconds']:.1f} s: {st['outputs_per_s']:.1f} tok/s (client "
                                 f"{r['output_tok_s']:.1f}), batch {st['mean_batch']:.1f}, busy {st['busy']:.0%}, "
                                 f"{st['full_team']:.0%} of steps on the full team")
                    lines.append(line)
        for c in sorted({c for _, c in steady}):
            if ("aggregated", c) in steady and ("disaggregated", c) in steady:
                lines.append(f"{label}c={c}: steady disaggregated/aggregated "
                             f"{steady[('disaggregated', c)] / steady[('aggregated', c)]:.0%}")
    return ["", *lines] if lines else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench efficiency", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-slot", type=int, default=2,
                   help="requests per point = concurrency x this (at least 4)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="the in-process engine's threads")
    p.add_argument("--served-threads", type=int, default=2, help="each aggregated replica's threads")
    p.add_argument("--served-replicas", type=int, default=1, help="aggregated replicas (KV-aware routed)")
    p.add_argument("--engine-thread", action="store_true",
                   help="every replica runs its engine on a thread, not in a child (the pools' engine_process)")
    p.add_argument("--ingress", choices=["proxy", "haproxy"], default="haproxy",
                   help="the servers' gateway.ingress: Serve's Python proxy, or HAProxy to the replica's own server")
    p.add_argument("--prefill-threads", type=int, default=2, help="the disaggregated prefill replica's threads")
    p.add_argument("--decode-threads", type=int, default=2, help="the disaggregated decode replica's threads")
    p.add_argument("--share-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine cores lend each other the cores they are not using (engine.share_cores)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--stream-interval", type=int, default=1, help="the servers' engine.stream_interval")
    p.add_argument("--port", type=int, default=8071)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the in-process engine and serve each mode this many times, the order alternating; "
                        "rows are medians, and each round gives its own ratios")
    p.add_argument("--step-trace", action="store_true",
                   help="the served engines trace their steps (DUET_STEP_TRACE): the busy share, team sizes and "
                        "steady-state rate of each engine at each point")
    p.add_argument("--json", default="out/bench_efficiency.json")
    a = p.parse_args(argv)
    trace = None
    if a.step_trace:  # before the first `serve_cli.start`: Ray's processes inherit it
        trace = Path(tempfile.mkdtemp(prefix="duet-steps-"))
        os.environ[step_trace.ENV] = str(trace)
    seeds = [1000 + c for c in a.concurrency]
    points = [(c, point_prompts(max(4, c * a.requests_per_slot), a.input_len, a.output_len, s))
              for c, s in zip(a.concurrency, seeds)]
    result: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                    "torch": torch.__version__, "threads": a.threads, "served_threads": a.served_threads,
                    "served_replicas": a.served_replicas, "engine_process": not a.engine_thread,
                    "ingress": a.ingress,
                    "pd_threads": [a.prefill_threads, a.decode_threads], "share_cores": a.share_cores,
                    "step_trace": a.step_trace, "rounds": a.rounds},
        "workload": {"input_len": a.input_len, "output_len": a.output_len, "dtype": a.dtype,
                     "stream_interval": a.stream_interval,
                     "requests": {c: len(ps) for c, ps in points}},
    }
    warmup = point_prompts(2, a.input_len, 4, seed=1)
    layout = Layout(dtype=a.dtype, port=a.port, stream_interval=a.stream_interval,
                    aggregated_threads=a.served_threads, aggregated_replicas=a.served_replicas,
                    pd_threads=(a.prefill_threads, a.decode_threads), engine_process=not a.engine_thread,
                    share_cores=a.share_cores, ingress=a.ingress)
    ways = ["in_process", *a.modes]
    result["rounds"] = []
    for number in range(a.rounds):
        order = ways if number % 2 == 0 else ways[::-1]  # A B C, C B A, ...: drift hits every way alike
        round_ = {}
        for way in order:
            print(way if a.rounds == 1 else f"{way} (round {number + 1} of {a.rounds})", flush=True)
            if way == "in_process":  # the ceilings once, with the first round's engine
                round_[way], ceilings = in_process(points, warmup, a.output_len, a.threads, a.dtype,
                                                   ceilings_too=not number)
                result.setdefault("ceilings", ceilings)
            else:
                round_[way] = served(way, points, seeds, a.input_len, a.output_len, layout, trace)
        result["rounds"].append(round_)
    for way in ways:
        result[way] = median_rows([round_[way] for round_ in result["rounds"]])
    print(table(result))
    write_json(a.json, result)
    return 0
