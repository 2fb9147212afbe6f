"""`python -m loadgen bench-serve ...` and `python -m loadgen plan ...`."""

from __future__ import annotations

import sys

from loadgen.cli import bench_serve_main, plan_main

COMMANDS = {"bench-serve": bench_serve_main, "plan": plan_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m loadgen {{{','.join(COMMANDS)}}} [options]  (-h after a command for help)",
              file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
