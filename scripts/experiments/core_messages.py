"""What one engine-core step message costs to encode and decode, three ways.

The replica and its engine core process exchange one message per step (engine/
core_messages.py): every request's new outputs, the stats snapshot, the KV events.
This times a step of `--outputs` decoding requests (one new token each, a
realistic `RequestOutput`) encoded and decoded as

1. a positional tuple, pickled (the protocol before the typed messages);
2. the typed `Step` dataclass, pickled (what `Connection.send` does today);
3. the same message as msgspec Structs, msgpack-encoded with typed decoding.

Prints microseconds per round trip (encode + decode) and the bytes, and writes JSON.
Run: python scripts/experiments/core_messages.py [--outputs 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core_messages import Step  # noqa: E402
from engine.request import FinishReason, RequestOutput  # noqa: E402
from engine.stats import EngineStats  # noqa: E402


class StructOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class StructStats(msgspec.Struct, array_like=True):
    fields: list[float]


class StructStep(msgspec.Struct, array_like=True):
    outputs: list[StructOutput]
    stats: StructStats


def outputs(n: int) -> list[RequestOutput]:
    return [RequestOutput(request_id=f"chatcmpl-{i:032x}", new_token_ids=[1000 + i], text=" word",
                          finished=False, finish_reason=None, num_prompt_tokens=128, num_cached_tokens=0,
                          num_output_tokens=40 + i)
            for i in range(n)]


def timed(fn, reps: int) -> float:
    """Median microseconds of one call over 7 runs of `reps` calls."""
    runs = []
    for _ in range(7):
        began = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - began) / reps * 1e6)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    outs, stats = outputs(args.outputs), EngineStats()
    as_tuple = ("step", outs, stats, [], [], None)
    as_step = Step(outs, stats, [], [], None)
    struct = StructStep([StructOutput(o.request_id, o.new_token_ids, o.text, o.finished,
                                      o.finish_reason.value if isinstance(o.finish_reason, FinishReason) else None,
                                      o.num_prompt_tokens, o.num_cached_tokens, o.num_output_tokens) for o in outs],
                        StructStats([float(v) for v in dataclasses.astuple(stats) if isinstance(v, (int, float))]))
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StructStep)
    ways = {
        "tuple + pickle": (lambda: pickle.loads(pickle.dumps(as_tuple, protocol=5)), pickle.dumps(as_tuple, 5)),
        "Step dataclass + pickle": (lambda: pickle.loads(pickle.dumps(as_step, protocol=5)), pickle.dumps(as_step, 5)),
        "msgspec Structs + msgpack": (lambda: dec.decode(enc.encode(struct)), enc.encode(struct)),
    }
    result = {"outputs_per_step": args.outputs, "python": sys.version.split()[0], "msgspec": msgspec.__version__,
              "ways": {}}
    for name, (fn, blob) in ways.items():
        us = timed(fn, args.reps)
        result["ways"][name] = {"round_trip_us": round(us, 1), "bytes": len(blob)}
        print(f"{name:28s} {us:8.1f} us round trip  {len(blob):6d} bytes")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
