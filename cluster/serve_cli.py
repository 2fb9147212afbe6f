"""`duet serve`: start (or join) a Ray cluster, deploy, wait for /ready, print the
URL, and shut everything down cleanly on Ctrl-C."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

from cluster.config import ClusterConfig, ConfigError, load_config
from engine.weights import served_model_name

log = logging.getLogger("duet")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the cluster: gateway + prefill/decode pools on Ray Serve")
    p.add_argument("--config", default=None, help="cluster YAML (see deploy/)")
    p.add_argument("--mode", choices=["disaggregated", "aggregated"], default=None)
    p.add_argument("--prefill-replicas", type=int, default=None)
    p.add_argument("--decode-replicas", type=int, default=None)
    p.add_argument("--replicas", type=int, default=None, help="aggregated pool replicas")
    p.add_argument("--transfer-backend", choices=["nixl", "torch"], default=None)
    p.add_argument("--ingress", choices=["proxy", "haproxy"], default=None,
                   help="what carries HTTP to the replicas that decode, each the gateway (gateway.ingress): "
                        "HAProxy (the default), or Serve's Python proxy")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--print-serve-config", action="store_true",
                   help="print the generated Ray Serve config (what is deployed) as YAML and exit")
    p.add_argument("--serve-config", default=None, metavar="FILE",
                   help="deploy this Serve config (e.g. a Helm chart's serveConfigV2) instead of generating one")


def config_from_args(args) -> ClusterConfig:
    return load_config(
        args.config,
        {
            "mode": args.mode,
            "prefill.replicas": args.prefill_replicas,
            "decode.replicas": args.decode_replicas,
            "aggregated.replicas": args.replicas,
            "transfer.backend": args.transfer_backend,
            "engine.model": args.model,
            "engine.dtype": args.dtype,
            "gateway.host": args.host,
            "gateway.port": args.port,
            "gateway.ingress": args.ingress,
        },
    )


def start(cfg: ClusterConfig, address: str | None = None, ready_timeout: float = 300.0,
          serve_config: dict | None = None) -> str:
    """Deploy `cfg` (or `serve_config`, the Serve config that deploys it) and block
    until /ready answers 200; returns the base URL."""
    import ray

    joining = bool(address) or ray.is_initialized()
    if cfg.gateway.ingress == "haproxy" and not joining:
        use_haproxy()

    from cluster.app import CONTROLLER_ENV, REPLICA_ENV
    from cluster.ray_start import init_local
    from cluster.serve_config import deploy, deploy_config

    if not ray.is_initialized():
        if address:
            ray.init(address=address, runtime_env={"env_vars": REPLICA_ENV}, logging_level=logging.WARNING)
        else:
            # Room for every pool at its largest: Ray's CPUs are a reservation, and on
            # one machine more replicas share the same cores. "local": a new cluster,
            # never the one a `ray start` on this machine last recorded.
            cpus = max(os.cpu_count() or 1, int(cfg.required_cpus(at_most=True) + 0.999))
            init_local(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING,
                       runtime_env={"env_vars": REPLICA_ENV})
    if cfg.gateway.ingress == "haproxy" and joining:
        check_cluster_haproxy()
    cfg.check_fits(ray.cluster_resources().get("CPU", 0))
    _start_serve(cfg, CONTROLLER_ENV)
    if serve_config is not None:
        deploy_config(serve_config, ready_timeout)
    else:
        deploy(cfg, ready_timeout)  # the generated Serve config (cluster/serve_config.py), as a RayService would
    url = f"http://{'127.0.0.1' if cfg.gateway.host == '0.0.0.0' else cfg.gateway.host}:{cfg.gateway.port}"
    wait_ready(url, ready_timeout)
    if cfg.gateway.ingress == "haproxy" and not address:  # this machine's HAProxy: the one Ray started here
        wait_haproxy_servers(cfg.ingress_deployment(), HAPROXY_SERVERS_WAIT_S)
    return url


# A stopping ingress replica keeps serving this long, so that HAProxy (which reloads
# within 0.1 s of a change) stops sending it connections first. Ray's default, 30 s,
# is sized for clusters whose routers update slowly; it would make every redeploy and
# Ctrl-C wait half a minute.
HAPROXY_DRAIN_S = "5"


# `serve.start` waits for the node's proxy (HAProxy's manager actor) to report ready; on a
# loaded machine the controller has found it slow, killed it and started another while
# that wait went on, and `serve.start` raised the dead actor's error. A second call joins
# the running controller; the deploy then waits for /ready, which needs the new proxy.
SERVE_START_TRIES = 3


def _start_serve(cfg: ClusterConfig, controller_env: dict[str, str]) -> None:
    import ray
    from ray import serve

    for attempt in range(1, SERVE_START_TRIES + 1):
        try:
            serve.start(http_options={"host": cfg.gateway.host, "port": cfg.gateway.port},
                        controller_options={"runtime_env": {"env_vars": controller_env}})
            return
        except (ray.exceptions.RayActorError, TimeoutError) as e:
            if attempt == SERVE_START_TRIES:
                raise RuntimeError(f"Serve's proxy did not start after {attempt} tries (is the machine "
                                   f"overloaded? {type(e).__name__}: {str(e).splitlines()[0]})") from e
            log.warning("Serve's proxy was not ready (%s); trying again (%d of %d)",
                        type(e).__name__, attempt + 1, SERVE_START_TRIES)


# What a Ray cluster must run with for `gateway.ingress: haproxy`: Serve's HAProxy
# ingress, and the request body forwarded to the ingress request router.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}


def use_haproxy() -> None:
    """`gateway.ingress: haproxy` on the Ray this process starts."""
    # Serve reads the flag when its modules are imported, in every process: set before
    # Ray starts, it reaches the controller, the per-node ingress managers and the
    # replicas. The driver's own copy does not matter: it deploys through the controller.
    # The ingress request router reads the prompt (routing/router/ingress.py).
    os.environ.update(HAPROXY_ENV)
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", HAPROXY_DRAIN_S)


def check_cluster_haproxy() -> None:
    """A Ray cluster this process joined runs with what `gateway.ingress: haproxy` needs,
    or `duet serve` stops here, naming the setting. Serve reads the switch in each of
    the cluster's processes, from the environment its `ray start` had: a task of no
    CPUs reads that environment (this process's own does not matter)."""
    import ray

    @ray.remote(num_cpus=0)
    def cluster_env() -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in HAPROXY_ENV}

    seen = ray.get(cluster_env.remote(), timeout=120)
    missing = [f"{k}={v}" for k, v in HAPROXY_ENV.items() if seen.get(k) != v]
    if missing:
        raise ConfigError("gateway.ingress", "haproxy (the default) needs the Ray cluster started with "
                          f"{' '.join(missing)} (in the environment of every `ray start`; the Helm chart sets "
                          "it); restart the cluster so, or set gateway.ingress: proxy (Serve's Python proxy, "
                          "slower: every streamed chunk crosses a Ray hop)")


def _scaling(pool) -> str:
    a = pool.autoscaling
    if pool.scaling == "fixed":
        return ""
    return f" ({a.policy} {a.min_replicas}-{a.max_replicas})"


# Ray's default port of HAProxy's stats page (RAY_SERVE_HAPROXY_STATS_PORT).
HAPROXY_STATS_PORT = int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404"))
# HAProxy reloads within about a second of a change; past this, serving goes on anyway.
HAPROXY_SERVERS_WAIT_S = 15.0


def servers_up(stats_csv: str, app: str, deployment: str) -> int:
    """Replicas of `app`'s `deployment` that HAProxy forwards the app's requests to and
    finds UP, from its stats page as CSV (one row per backend server; column 18 is the
    status, "UP", or "UP 1/2" while its checks settle)."""
    rows = [line.split(",") for line in stats_csv.splitlines() if not line.startswith("#")]
    prefix = f"SERVE_REPLICA_{app}-{deployment}-"
    return sum(1 for row in rows if len(row) > 17 and row[0] == f"http-{app}" and row[1].startswith(prefix)
               and row[17].startswith("UP"))


def haproxy_servers_up(app: str, deployment: str) -> int:
    """`servers_up` of this machine's HAProxy."""
    with urllib.request.urlopen(f"http://127.0.0.1:{HAPROXY_STATS_PORT}/stats;csv", timeout=5) as r:
        return servers_up(r.read().decode(), app, deployment)


def wait_haproxy_servers(deployment: str, timeout: float) -> None:
    """/ready answers once HAProxy knows one ingress replica; wait until it has reloaded
    with every running one. Until then HAProxy cannot pin a request to a replica it does
    not know, and the ingress request router's choice of it goes through Serve's
    fallback proxy instead: served, but not where its prefix is."""
    from ray import serve

    from cluster.serve_config import APP_NAME

    deadline = time.monotonic() + timeout
    running, up = 0, -1
    while time.monotonic() < deadline:
        try:
            status = serve.status().applications[APP_NAME].deployments[deployment]
            running = status.replica_states.get("RUNNING", 0)
            up = haproxy_servers_up(APP_NAME, deployment)
        except Exception as e:  # no stats page (yet): keep asking until the deadline
            log.debug("HAProxy stats: %s", e)
        if running and up >= running:
            return
        time.sleep(0.2)
    log.warning("HAProxy forwards to %s of %s running %s replicas after %.0f s; serving anyway",
                max(up, 0), running, deployment, timeout)


def wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:
            last = str(e)
        time.sleep(1)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout:.0f}s ({last})")


def _read_serve_config(path: str) -> tuple[dict, ClusterConfig]:
    """A Serve config file and the cluster config it deploys."""
    import yaml

    from cluster.serve_config import cluster_config_of

    config = yaml.safe_load(Path(path).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a Serve config must be a mapping")
    return config, cluster_config_of(config)


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_config = None
    try:
        if args.serve_config:
            serve_config, cfg = _read_serve_config(args.serve_config)
        else:
            cfg = config_from_args(args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"duet serve: invalid config: {e}", file=sys.stderr)
        return 2
    if args.print_serve_config:
        import yaml

        from cluster.serve_config import serve_config

        print(yaml.safe_dump(serve_config(cfg), sort_keys=False), end="")
        return 0
    t0 = time.monotonic()
    try:
        url = start(cfg, args.address, args.ready_timeout, serve_config)
    except ConfigError as e:
        print(f"duet serve: {e}", file=sys.stderr)
        stop()
        return 2
    pools = ", ".join(f"{n} x{p.initial_replicas()}{_scaling(p)}" for n, p in cfg.pools().items())
    print(f"duet is serving {served_model_name(cfg.engine)} ({cfg.mode}: {pools}; transfer {cfg.transfer.backend}) "
          f"at {url}/v1  [ready in {time.monotonic() - t0:.0f}s]", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    # A shell's background job inherits SIGINT ignored; Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        while not done.wait(1):
            pass
    except KeyboardInterrupt:
        pass
    print("shutting down...", flush=True)
    stop()
    return 0
