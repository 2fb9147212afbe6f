"""Imports between the rooms run one way (docs/ARCHITECTURE.md):

    engine, telemetry, autoscaling -> kvtransfer -> prefill, decode -> routing -> cluster, bench

A room imports only rooms to its left; prefill and decode never import each other.
cluster (the composition root) and bench (the `duet bench` targets) share the top:
bench may import cluster, since its targets drive the composition root (they start
`duet serve` through cluster.serve_cli, read cluster.config, build the Serve app,
bring up namespace clusters); nothing else imports cluster; and nothing imports bench
but cluster/cli.py, which dispatches `duet bench TARGET` to it. loadgen is a client
and imports no server room, only the autoscaling room's pure policy code (the
goodput policy and the placement rule: its simulators run the same code). Inside a
room, modules import each other without a circle, so each can be read (and loaded)
after the ones it needs: `engine/config.py` imports no engine module. Every import
counts: lazy ones inside functions, type-only ones, and `importlib.import_module` of
a constant name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LEVEL = {"engine": 0, "telemetry": 0, "autoscaling": 0, "kvtransfer": 1, "prefill": 2, "decode": 2, "routing": 3,
         "cluster": 4, "bench": 4}
# (room, target) imports beside each other at one level, and why they are allowed.
SIDEWAYS = {("bench", "cluster")}  # the benchmarks start and configure the cluster they measure
# Rooms only the named modules may import: the CLI is bench's one way in.
ONLY_FROM = {"bench": {"cluster/cli.py"}}
CLIENTS = {"loadgen"}
CLIENT_MAY_IMPORT = {"autoscaling"}  # pure policy code, no server


def _import_module_name(node: ast.Call) -> str | None:
    """The constant module name of an `importlib.import_module("...")` call."""
    f = node.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module")
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module name) of every absolute import in one module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and (name := _import_module_name(node)):
            out.append((node.lineno, name))
    return out


def _within(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def wrong_way(room: str, target: str, module: str) -> bool:
    """Whether `module` (a path under the repository) of `room` may not import the
    module `target` (dotted)."""
    target_room = target.split(".")[0]
    if target_room == room or target_room not in LEVEL:
        return False
    if target_room in ONLY_FROM:
        return module not in ONLY_FROM[target_room]
    if (room, target_room) in SIDEWAYS:
        return False
    if room in CLIENTS:
        return not _within(target, CLIENT_MAY_IMPORT)
    return LEVEL[target_room] >= LEVEL[room]


def violations(root: Path) -> list[str]:
    bad = []
    for room in sorted({*LEVEL, *CLIENTS}):
        for path in sorted((root / room).rglob("*.py")):
            module = path.relative_to(root).as_posix()
            for line, target in imported_modules(path):
                if wrong_way(room, target, module):
                    bad.append(f"{module}:{line} {room} imports {target.split('.')[0]}")
    return bad


def test_imports_run_one_way():
    assert violations(REPO) == []


def _module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _imported_names(path: Path) -> set[str]:
    """Every module `path` may import: `imported_modules`, and `a.b` for each `from a
    import b` (b may be a module)."""
    names = {name for _, name in imported_modules(path)}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def circles(root: Path) -> list[list[str]]:
    """Each set of modules of one room that import each other round in a circle
    (a strongly connected component of the room's import graph), sorted."""
    found = []
    for room in sorted({*LEVEL, *CLIENTS}):
        paths = {_module_name(root, p): p for p in (root / room).rglob("*.py")}
        graph = {m: sorted(t for t in _imported_names(p) if t in paths and t != m) for m, p in paths.items()}
        found += [sorted(c) for c in _components(graph) if len(c) > 1]
    return sorted(found)


def _components(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    out.append(comp)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(graph[nxt])))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return out


def test_no_room_imports_in_a_circle():
    assert circles(REPO) == []


def test_the_check_sees_a_circle(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("from engine.b import x\n")
    (tmp_path / "engine" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                              "if TYPE_CHECKING:\n    from engine import c\n")
    (tmp_path / "engine" / "c.py").write_text("def f():\n    import engine.a\n")
    (tmp_path / "engine" / "d.py").write_text("import engine.a\n")
    assert circles(tmp_path) == [["engine.a", "engine.b", "engine.c"]]


def test_the_check_sees_a_wrong_arrow(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text("def f():\n    from routing.router import policy\n")
    (tmp_path / "prefill").mkdir()
    (tmp_path / "prefill" / "y.py").write_text("import decode.server\nimport engine.engine\n")
    (tmp_path / "loadgen").mkdir()
    (tmp_path / "loadgen" / "z.py").write_text("from kvtransfer import handoff\n"
                                               "from autoscaling.placement import choose_placement\n"
                                               "from routing.router.policy import RouterConfig\n")
    assert violations(tmp_path) == [
        "engine/x.py:2 engine imports routing",
        "loadgen/z.py:1 loadgen imports kvtransfer",
        "loadgen/z.py:3 loadgen imports routing",
        "prefill/y.py:1 prefill imports decode",
    ]


def test_bench_sits_beside_cluster_and_only_the_cli_reaches_it(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "t.py").write_text("from cluster import serve_cli\nimport engine.engine\n")
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "cli.py").write_text("import importlib\nimportlib.import_module('bench.engine')\n")
    (tmp_path / "cluster" / "app.py").write_text("def f():\n    from bench import cluster\n")
    (tmp_path / "routing").mkdir()
    (tmp_path / "routing" / "r.py").write_text("import importlib\nimportlib.import_module('cluster.config')\n")
    (tmp_path / "loadgen").mkdir()
    (tmp_path / "loadgen" / "z.py").write_text("import bench.kv\n")
    assert violations(tmp_path) == [
        "cluster/app.py:2 cluster imports bench",
        "loadgen/z.py:1 loadgen imports bench",
        "routing/r.py:2 routing imports cluster",
    ]
