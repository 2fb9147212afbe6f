"""`duet bench move`: the longest gap a client sees when its decode replica goes away,
its sequence moved with its KV against recomputed by a migration.

One `duet serve` (1 prefill + 2 decode replicas, NIXL). For each context length
(prompt + the tokens generated when the replica goes away), each trial streams two
greedy completions at once (the decode router puts one on each replica), waits
until both have streamed `--event-after` chunks, and then:

- **move**: resizes the decode pool to 1 (Serve drains one replica; it hands its
  decoding sequence to the other with its KV: `transfer.move_on_drain`), then back to 2;
- **recompute**: kills one decode replica; the gateway migrates its stream (prefill
  computes prompt + tokens so far again, another decode replica goes on), and Serve
  starts a replacement.

The affected stream is the one with the longest gap; the table gives that gap (median
of `--repeats` trials) beside the streams' median gap between chunks (their ITL). The
move's gap is drain detection + one engine command + the hop back through the
gateway + the pull of the whole context's KV + one step; the recompute's is failure
detection + a prefill of the whole context + the prompt's pull + one step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.json_output import write_json
from bench.machine_ceilings import cpu_flags
from cluster import serve_cli
from cluster.config import ClusterConfig, load_config
from cluster.serve_config import deploy

WORDS = "The lighthouse keeper counted the waves and wrote each one down in a small book. "


def prompt_of(tokenizer, num_tokens: int) -> str:
    """Text of about `num_tokens` tokens."""
    ids = tokenizer.encode(WORDS * (num_tokens // 8 + 2))[:num_tokens]
    return tokenizer.decode(ids)


class Stream:
    """One streamed completion in a thread: when each chunk arrived."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        self.arrivals: list[float] = []
        self.error: str | None = None
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if event.get("choices") and event["choices"][0].get("text"):
                            self.arrivals.append(time.monotonic())
        except Exception as e:  # reported in the trial's row
            self.error = f"{type(e).__name__}: {e}"[:300]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.arrivals, self.arrivals[1:])]


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.05)


def decode_running() -> int:
    from ray import serve

    app = serve.status().applications["duet"]
    return app.deployments["decode"].replica_states.get("RUNNING", 0)


def kill_one_decode_replica() -> None:
    import ray

    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::duet#decode#"))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def trial(url: str, cfg: ClusterConfig, kind: str, prompt: str, max_tokens: int, event_after: int) -> dict:
    streams = [Stream(url, prompt, max_tokens)]
    wait_for(lambda: len(streams[0].arrivals) >= 1, 300, "first chunk")  # the router sees it before the second
    streams.append(Stream(url, prompt, max_tokens))
    wait_for(lambda: all(len(s.arrivals) >= event_after or s.error for s in streams), 300, "chunks before the event")
    if kind == "move":
        smaller = cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"replicas": 1})})
        deploy(smaller)  # returns once the drained replica has stopped
    else:
        kill_one_decode_replica()
    for s in streams:
        s.join(600)
    if kind == "move":
        deploy(cfg)
    wait_for(lambda: decode_running() == 2, 300, "two decode replicas again")
    gaps = [g for s in streams for g in s.gaps_ms]
    longest = max(max(s.gaps_ms) for s in streams)
    return {"longest_gap_ms": round(longest, 1), "median_gap_ms": round(statistics.median(gaps), 1),
            "chunks": [len(s.arrivals) for s in streams], "errors": [s.error for s in streams if s.error]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet bench move", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 2048],
                   help="tokens of context (prompt + generated) when the replica goes away")
    p.add_argument("--event-after", type=int, default=32, help="chunks each stream has when it happens")
    p.add_argument("--after-event", type=int, default=48, help="tokens generated after it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", type=Path, default=Path("bench-move.json"))
    a = p.parse_args(argv)
    from engine.tokenizer import load_tokenizer

    longest = max(a.contexts) + a.after_event
    cfg = load_config(overrides={
        "mode": "disaggregated", "gateway.port": a.port, "decode.replicas": 2,
        "engine.max_model_len": max(1024, 1 << (longest - 1).bit_length()),
        "engine.num_kv_blocks": 2 * (-(-longest // 16)) + 16,
        "gateway.max_migrations": 1,
    })
    tokenizer = load_tokenizer(cfg.engine.model)
    url = serve_cli.start(cfg)
    rows = []
    try:
        for context in a.contexts:
            prompt = prompt_of(tokenizer, context - a.event_after)
            for kind in ("move", "recompute"):
                trials = [trial(url, cfg, kind, prompt, a.event_after + a.after_event, a.event_after)
                          for _ in range(a.repeats)]
                row = {"context_tokens": context, "kind": kind,
                       "longest_gap_ms": statistics.median(t["longest_gap_ms"] for t in trials),
                       "median_gap_ms": statistics.median(t["median_gap_ms"] for t in trials), "trials": trials}
                rows.append(row)
                print(f"context {context:5d} {kind:9s}: longest gap {row['longest_gap_ms']:8.1f} ms "
                      f"(median gap {row['median_gap_ms']:.1f} ms) over {a.repeats} trials", flush=True)
    finally:
        serve_cli.stop()
    result = {"machine": {"platform": platform.platform(), "cpu_flags": cpu_flags()},
              "config": {"prefill": 1, "decode": 2, "backend": cfg.transfer.backend, "event_after": a.event_after,
                         "after_event": a.after_event, "repeats": a.repeats},
              "rows": rows}
    write_json(a.out, result)
    return 0
