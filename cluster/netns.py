"""A multi-node Ray cluster on one Linux machine: one network namespace per node.

Each node is its own `ray start` inside its own namespace, with its own IP on a
private bridge, so everything between nodes (Ray's own traffic, the KV handoff,
the lease channel, Redis) crosses a real network stack: no loopback shortcut, no
shared-memory transport unless a backend is told it may use one (NIXL is given
`UCX_TLS=tcp,self` for this cluster). Needs root and `ip` (iproute2).

    bridge duet-br (10.77.0.1/24, in the root namespace: Redis listens here)
      ├── veth ── netns duet-head     10.77.0.10  ray head, the gateway
      ├── veth ── netns duet-prefill  10.77.0.11  ray worker: duet/prefill
      └── veth ── netns duet-decode   10.77.0.12  ray worker: duet/decode

Processes in a namespace are found with `ip netns pids` (network namespaces do not
separate PIDs), which is how one node is killed without touching the others.

With `rootfs` set (a container image's file system, mounted, with /proc, /sys and
/dev inside), every node runs `chroot`ed into it as the image's user: the image's
own Python, Ray and duet, as the pods of the Helm chart would, not this environment's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster.pools import node_resources
from cluster.ray_start import NODE_START_TRIES
from cluster.serve_cli import HAPROXY_DRAIN_S, HAPROXY_ENV

log = logging.getLogger(__name__)

RAY_PORT = 6380
# Each node's Ray metrics agent serves Prometheus here (on the node's own IP).
METRICS_PORT = 8080
# Replicas report metrics every second (Ray's default is 10 s).
SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000}
# Where the image (deploy/Containerfile) has its virtual environment.
IMAGE_VENV = "/home/ray/venv"
# Serve's HAProxy ingress on every node, as the Helm chart sets it on every pod
# (`gateway.ingress: haproxy`, the default, needs it of the whole cluster).
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONHASHSEED": "0",
            "HF_HUB_OFFLINE": "1", "RAY_prestart_worker_first_driver": "0",  # why: cluster/cli.py
            **HAPROXY_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": HAPROXY_DRAIN_S}


@dataclass(frozen=True)
class NodeSpec:
    """One Ray node: its name (the namespace is `<prefix>-<name>`), the duet node
    groups it offers (`duet/<group>` resources), and its CPUs."""

    name: str
    node_groups: tuple[str, ...] = ()
    num_cpus: float = 1.0
    head: bool = False
    # `ray start` flags as a RayService's rayStartParams give them ((key, value) pairs,
    # values as Ray reads them): used in place of the flags made from the fields above,
    # to start a node with the Helm chart's own command line.
    ray_start_params: tuple[tuple[str, str], ...] = ()


# The layout of docs/deploy.md and the multi-node tests: one node per pool, and a head
# that runs Serve's controller and HAProxy (the HTTP ingress is the decode replica).
DEFAULT_NODES = (
    NodeSpec("head", num_cpus=1, head=True),
    NodeSpec("prefill", ("prefill",), num_cpus=1),
    NodeSpec("decode", ("decode",), num_cpus=1),
)


@dataclass
class NamespaceCluster:
    nodes: Sequence[NodeSpec] = DEFAULT_NODES
    prefix: str = "duet"
    subnet: str = "10.77.0"  # a /24: the bridge is .1, nodes .10 up
    object_store_bytes: int = 128 << 20
    env: dict[str, str] = field(default_factory=dict)
    rootfs: Path | None = None  # run the nodes from this file system (an image's)
    rootfs_user: str = "1000:100"  # uid:gid inside it (the image's `ray` user)

    def __post_init__(self) -> None:
        heads = [n for n in self.nodes if n.head]
        if len(heads) != 1:
            raise ValueError("exactly one node must be the head")
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    # -- names and addresses -------------------------------------------------

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def bridge_ip(self) -> str:
        """The root namespace's address on the bridge (where a Redis for the cluster listens)."""
        return f"{self.subnet}.1"

    def netns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def ip(self, node: str) -> str:
        return f"{self.subnet}.{10 + self._index[node]}"

    @property
    def head(self) -> NodeSpec:
        return next(n for n in self.nodes if n.head)

    @property
    def address(self) -> str:
        """The Ray cluster's address (`ray start --address`, `duet serve --address`)."""
        return f"{self.ip(self.head.name)}:{RAY_PORT}"

    def in_netns(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `node`'s namespace (and, with `rootfs`, chrooted into it)."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.netns(node), *self.chroot_argv(argv)]

    def chroot_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run in the cluster's file system: chrooted into `rootfs` as its
        user (`chroot` found on this host's PATH: the node's is the image's), or as is."""
        if self.rootfs is None:
            return list(argv)
        return [shutil.which("chroot") or "/usr/sbin/chroot", f"--userspec={self.rootfs_user}", str(self.rootfs),
                *argv]

    def node_env(self) -> dict[str, str]:
        """The environment of a node's processes. From an image's file system: the
        image's PATH and home, nothing of this environment's (its venv is not there)."""
        if self.rootfs is None:
            return {**os.environ, **NODE_ENV, **self.env}
        image = {"PATH": f"{IMAGE_VENV}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/home/ray",
                 "VIRTUAL_ENV": IMAGE_VENV, "LANG": "C.UTF-8"}
        return {**image, **NODE_ENV, **self.env}

    def executable(self, name: str) -> str:
        """`python`, `ray` or `duet` as a node runs it."""
        if self.rootfs is not None:
            return f"{IMAGE_VENV}/bin/{name}"
        here = Path(sys.executable).parent / name
        return str(here) if here.exists() else name

    def metrics_url(self, node: str) -> str:
        return f"http://{self.ip(node)}:{METRICS_PORT}/metrics"

    # -- network ---------------------------------------------------------------

    def create_network(self) -> None:
        """The bridge, and per node a namespace joined to it by a veth pair."""
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for n in self.nodes:
            ns, host_end = self.netns(n.name), self._veth(n.name)
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(n.name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # Ray finds a process's own address from the route to the outside: let
            # that route leave by the bridge (nothing is forwarded beyond it). DNS
            # would then time out rather than fail (torch's TCPStore looks names up
            # while it connects), so the namespace gets a resolver that answers at
            # once: `ip netns exec` mounts /etc/netns/<ns>/resolv.conf.
            _ip("-n", ns, "route", "add", "default", "via", self.bridge_ip)
            etc = self._etc(n.name)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text("# duet namespace cluster: no DNS, fail fast\nnameserver 127.0.0.1\n")

    def _etc(self, node: str) -> Path:
        return Path("/etc/netns") / self.netns(node)

    def _veth(self, node: str) -> str:
        return f"{self.prefix}-v{self._index[node]}"  # interface names: 15 characters at most

    # -- Ray nodes ---------------------------------------------------------------

    def ray_start_argv(self, n: NodeSpec) -> list[str]:
        argv = [self.executable("ray"), "start", "--node-ip-address", self.ip(n.name),
                "--object-store-memory", str(self.object_store_bytes), "--disable-usage-stats"]
        params = dict(n.ray_start_params) or {"num-cpus": f"{n.num_cpus:g}", "metrics-export-port": str(METRICS_PORT)}
        if n.node_groups and not n.ray_start_params:
            params["resources"] = json.dumps(node_resources(n.node_groups))
        argv += [f"--{key}={value}" for key, value in params.items()]
        if n.head:
            argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false",
                     "--system-config", json.dumps(SYSTEM_CONFIG)]
        else:
            argv += ["--address", self.address]
        return argv

    def start_node(self, node: str, timeout_s: float = 120.0, tries: int = NODE_START_TRIES) -> None:
        """`ray start` in the node's namespace; tried again (after killing what the try
        left) when Ray's fixed 30 s wait for the raylet ran out on a busy machine
        (cluster/ray_start.py)."""
        n = self.nodes[self._index[node]]
        for attempt in range(1, tries + 1):
            out = subprocess.run(self.in_netns(node, self.ray_start_argv(n)), env=self.node_env(),
                                 capture_output=True, text=True, timeout=timeout_s)
            if out.returncode == 0:
                return
            if "timed out during startup" not in out.stderr + out.stdout or attempt == tries:
                raise RuntimeError(f"ray start on {node} failed ({out.returncode}, try {attempt} of {tries}): "
                                   f"{out.stderr[-2000:]}")
            log.warning("ray start on %s timed out (try %d of %d): trying again", node, attempt, tries)
            self.kill_node(node)

    def start(self, timeout_s: float = 180.0) -> None:
        """The network, then the head, then every worker node; waits until Ray lists
        every node alive."""
        self.create_network()
        self.start_node(self.head.name)
        for n in self.nodes:
            if not n.head:
                self.start_node(n.name)
        self.wait_nodes(len(self.nodes), timeout_s)

    def alive_nodes(self) -> list[str]:
        """IPs of the nodes Ray's GCS lists as alive (asked from inside the head namespace)."""
        code = ("import json, ray; ray.init(address='auto', logging_level='ERROR');"
                "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))")
        out = subprocess.run(self.in_netns(self.head.name, [self.executable("python"), "-c", code]),
                             env={**self.node_env(), "RAY_ADDRESS": self.address},
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-1000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        alive: list[str] = []
        while time.monotonic() < deadline:
            try:
                alive = self.alive_nodes()
            except (RuntimeError, subprocess.TimeoutExpired, ValueError):
                alive = []
            if len(alive) >= n:
                return
            time.sleep(1)
        raise TimeoutError(f"{n} Ray nodes were not alive within {timeout_s:.0f} s (alive: {alive})")

    def pids(self, node: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns(node)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def raylet_pid(self, node: str) -> int | None:
        for pid in self.pids(node):
            try:
                exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if exe.endswith(b"/raylet"):
                return pid
        return None

    def kill_node(self, node: str, timeout_s: float = 30.0) -> None:
        """SIGKILL every process of `node` (its raylet first: the node is lost, not
        drained), and wait until none is left."""
        raylet = self.raylet_pid(node)
        if raylet is not None:
            _kill(raylet)
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids(node)) and time.monotonic() < deadline:
            for pid in pids:
                _kill(pid)
            time.sleep(0.2)
        if self.pids(node):
            raise RuntimeError(f"processes of {node} survived SIGKILL: {self.pids(node)}")

    def stop(self) -> None:
        """Kill every node (workers first), then remove the namespaces and the bridge.
        Safe to call on a half-built cluster."""
        for n in sorted(self.nodes, key=lambda n: n.head):
            if Path(f"/run/netns/{self.netns(n.name)}").exists():
                self.kill_node(n.name)
        for n in self.nodes:
            subprocess.run(["ip", "netns", "del", self.netns(n.name)], capture_output=True)
            shutil.rmtree(self._etc(n.name), ignore_errors=True)
            subprocess.run(["ip", "link", "del", self._veth(n.name)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._forget_address()

    def _forget_address(self) -> None:
        """`ray start` records the cluster it joined in Ray's temp dir, and a later
        `ray.init()` without an address joins that one instead of starting its own:
        forget this cluster once it is gone."""
        path = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        try:
            if path.read_text().strip() == self.address:
                path.unlink()
        except OSError:
            pass


def available() -> str | None:
    """Why a namespace cluster cannot run here (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
