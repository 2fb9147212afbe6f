"""The namespace cluster's command lines (cluster/netns.py), built without running
them: node flags from a NodeSpec or from a chart group's rayStartParams, and nodes
run from an image's file system."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.netns import DEFAULT_NODES, IMAGE_VENV, NamespaceCluster, NodeSpec

pytestmark = pytest.mark.unit


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_default_nodes_offer_their_groups():
    c = NamespaceCluster()
    head, prefill, _ = (c.ray_start_argv(n) for n in DEFAULT_NODES)
    assert json.loads(flags(prefill)["resources"]) == {"duet/prefill": 1000}
    assert flags(head)["num-cpus"] == "1" and "--head" in head and "--address" not in head
    assert prefill[prefill.index("--address") + 1] == c.address


def test_a_chart_groups_params_replace_the_specs_own_flags():
    node = NodeSpec("decode", ("decode",), num_cpus=4,
                    ray_start_params=(("num-cpus", "2"), ("resources", '{"duet/decode":1000}')))
    got = flags(NamespaceCluster(nodes=(NodeSpec("head", head=True), node)).ray_start_argv(node))
    assert got["num-cpus"] == "2" and got["resources"] == '{"duet/decode":1000}'
    assert "metrics-export-port" not in got  # only what the chart says


def test_nodes_from_an_image_run_its_programs_chrooted_as_its_user():
    c = NamespaceCluster(rootfs=Path("/mnt/image"))
    argv = c.in_netns("head", [c.executable("ray"), "status"])
    assert argv[1:4] == ["netns", "exec", "duet-head"]
    assert argv[4].endswith("chroot") and argv[5:] == ["--userspec=1000:100", "/mnt/image", f"{IMAGE_VENV}/bin/ray",
                                                       "status"]
    env = c.node_env()
    assert env["PATH"].startswith(f"{IMAGE_VENV}/bin:") and env["HOME"] == "/home/ray"
    assert ".venv" not in env["PATH"]  # nothing of this environment
    assert NamespaceCluster().in_netns("head", ["x"])[4:] == ["x"]
