"""Where does one request's decode step run fastest: stepped by a process's main
thread, on a side thread under an event loop (a replica's `AsyncEngine`), or in an
engine core child process (a replica's `EngineCoreClient`)?

Each placement lives in a worker process of its own: two engines that have run
parallel ops on two threads of one process slow each other down even while one idles
(measured: 15 ms steps became 24 ms beside an idle, warmed `AsyncEngine`). The same
engine config and the same greedy request (a 128-token prompt, 128 forced output
tokens) run one at a time, each placement in turn, `--rounds` times (A B C A B C ...),
so the drift of a KVM's neighbours falls on all three. Prints each round's TPOT (ms
between output tokens, the first excluded) and the medians; `--json` writes them.

    .venv/bin/python scripts/experiments/engine_placement.py --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import torch

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from engine.async_engine import start_engine, warm_up
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PROMPT = [1, *range(200, 327)]


def _tpot_ms(times: list[float]) -> float:
    """Mean ms between output tokens after the first (the prefill's)."""
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def main_thread_engine(threads: int, output_len: int = 128) -> tuple[Engine, SamplingParams]:
    """An engine to step on this process's main thread, warmed up, and the request the
    experiments in this folder time (`output_len` forced output tokens, greedy)."""
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(dtype="float32", device="cpu"), role="aggregated")
    warm_up(engine)
    return engine, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)


def stepped(engine: Engine, sampling: SamplingParams, requests: int) -> float:
    """This thread calls `engine.step()` itself: no event loop, no hand-off."""
    tpots = []
    for _ in range(requests):
        rid = engine.add_request(PROMPT, sampling)
        times: list[float] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.new_token_ids:
                    times.append(time.perf_counter())
        tpots.append(_tpot_ms(times))
    return statistics.median(tpots)


async def streamed(engine, sampling: SamplingParams, requests: int) -> float:
    """An `AsyncEngine` or `EngineCoreClient`: each output batch as the stream yields it."""
    tpots = []
    for i in range(requests):
        stream = await engine.add_request(f"r{i}-{time.monotonic_ns()}", PROMPT, sampling)
        times = [time.perf_counter() async for _ in stream]
        tpots.append(_tpot_ms(times))
    return statistics.median(tpots)


PLACEMENTS = ("main_thread", "side_thread", "child_process")


def _worker(placement: str, threads: int, output_len: int, conn) -> None:
    """Builds one placement's engine, then measures `requests` requests per command."""
    if placement == "main_thread":
        engine, sampling = main_thread_engine(threads, output_len)
        conn.send("ready")
        while (requests := conn.recv()) is not None:
            conn.send(stepped(engine, sampling, requests))
        return
    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    cfg = EngineConfig(dtype="float32", device="cpu")

    async def serve() -> None:
        engine = (start_engine(cfg, "aggregated", threads=threads) if placement == "side_thread"
                  else EngineCoreClient(cfg, "aggregated", threads=threads))
        try:
            conn.send("ready")
            while (requests := await asyncio.to_thread(conn.recv)) is not None:
                conn.send(await streamed(engine, sampling, requests))
        finally:
            engine.shutdown()

    asyncio.run(serve())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=3, help="requests per placement per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json")
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    workers = {}
    for placement in PLACEMENTS:  # one at a time: their warm-ups must not overlap
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(placement, a.threads, a.output_len, theirs))
        proc.start()
        assert ours.recv() == "ready"
        workers[placement] = (proc, ours)
    rounds = []
    try:
        for r in range(a.rounds):
            row = {}
            for placement, (_, conn) in workers.items():
                conn.send(a.requests)
                row[placement] = conn.recv()
            rounds.append(row)
            print(f"round {r}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    finally:
        for proc, conn in workers.values():
            conn.send(None)
            proc.join(60)
    medians = {k: statistics.median(row[k] for row in rounds) for k in PLACEMENTS}
    print("medians: " + "  ".join(f"{k} {v:.2f} ms" for k, v in medians.items()))
    if a.json:
        write_json(a.json, {"cpu_flags": cpu_flags(), "threads": a.threads, "output_len": a.output_len,
                            "requests_per_round": a.requests, "rounds": rounds, "median_tpot_ms": medians})


if __name__ == "__main__":
    main()
