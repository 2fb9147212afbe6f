"""Imports between the rooms run one way (docs/ARCHITECTURE.md):

    engine, telemetry, autoscaling -> kvtransfer -> prefill, decode -> routing -> cluster

A room imports only rooms to its left; prefill and decode never import each other;
nothing imports cluster (the composition root); loadgen is a client and imports no
server room, only the autoscaling policy (its simulator runs the same code). Every import counts, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LEVEL = {"engine": 0, "telemetry": 0, "autoscaling": 0, "kvtransfer": 1, "prefill": 2, "decode": 2, "routing": 3, "cluster": 4}
CLIENTS = {"loadgen"}
CLIENT_MAY_IMPORT = {"autoscaling"}  # pure policy code, no server


def imported_rooms(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in one module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def wrong_way(room: str, target: str) -> bool:
    if target == room or target not in LEVEL:
        return False
    if room in CLIENTS:
        return target not in CLIENT_MAY_IMPORT
    return LEVEL[target] >= LEVEL[room]


def violations(root: Path) -> list[str]:
    bad = []
    for room in sorted({*LEVEL, *CLIENTS}):
        for path in sorted((root / room).rglob("*.py")):
            for line, target in imported_rooms(path):
                if wrong_way(room, target):
                    bad.append(f"{path.relative_to(root)}:{line} {room} imports {target}")
    return bad


def test_imports_run_one_way():
    assert violations(REPO) == []


def test_the_check_sees_a_wrong_arrow(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text("def f():\n    from routing.router import policy\n")
    (tmp_path / "prefill").mkdir()
    (tmp_path / "prefill" / "y.py").write_text("import decode.server\nimport engine.engine\n")
    (tmp_path / "loadgen").mkdir()
    (tmp_path / "loadgen" / "z.py").write_text("from kvtransfer import handoff\n")
    assert violations(tmp_path) == [
        "engine/x.py:2 engine imports routing",
        "loadgen/z.py:1 loadgen imports kvtransfer",
        "prefill/y.py:1 prefill imports decode",
    ]
