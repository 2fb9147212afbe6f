"""`duet bench serve`: measure any OpenAI-compatible server with `vllm bench serve`'s
definitions (TTFT, TPOT, ITL, E2EL, goodput) over a sweep of request rates or
concurrencies; docs/loadgen.md.

The client is loadgen's, and loadgen/cli.py owns the flags (`python -m loadgen
bench-serve` takes the same ones): this target hands its arguments over unchanged.
"""

from __future__ import annotations

import sys

from loadgen.cli import bench_serve_main


def main(argv: list[str] | None = None) -> int:
    return bench_serve_main(sys.argv[1:] if argv is None else argv)
