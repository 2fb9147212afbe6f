"""The Serve config of a duet cluster, generated from its `ClusterConfig`.

One file describes the whole app the way Ray Serve's declarative API (and a KubeRay
`RayService`'s `serveConfigV2`) takes it: the app is built by `build` from the
cluster config carried in `args`, and when a pool uses the goodput policy the app
gets the application-level `autoscaling_policy` (cluster/autoscaler.py) with the
same config as its kwargs. Capacity profiles are inlined as numbers: the Serve
controller and the replicas may run on nodes that have no profile file. `duet serve` deploys exactly this.

A fixed pool's size travels as its deployment's `num_replicas` (the app's
`deployments:` list), not inside `args`: Serve restarts every replica of an app whose
args change, but only adds or drains replicas of a deployment whose `num_replicas`
changes. So resizing a fixed pool never restarts the others.
"""

from __future__ import annotations

import os

from cluster.app import REPLICA_ENV, build_app
from cluster.config import ClusterConfig
from cluster.pools import PoolConfig
from engine import model_cache
from routing.openai.access import KEYS_ENV

APP_NAME = "duet"  # the Serve application duet deploys
IMPORT_PATH = "cluster.serve_config:build"
POLICY_PATH = "cluster.autoscaler:GoodputAutoscaler"


def build(args: dict):
    """Serve's application builder (`import_path`): the app from `args["config"]`."""
    return build_app(ClusterConfig.model_validate(args["config"]))


def serve_config(cfg: ClusterConfig, env: dict[str, str] | None = None) -> dict:
    """The Serve config (`ServeDeploySchema`) that deploys `cfg`. `env`: extra
    environment for every process of the app (e.g. the API keys a joined cluster
    does not have)."""
    cfg = cfg.model_copy(update={"telemetry": cfg.telemetry.resolved()})  # this shell's OTEL_* variables
    carried = portable_config(without_fixed_sizes(cfg))
    app: dict = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": IMPORT_PATH,
        "args": {"config": carried},
        "runtime_env": {"env_vars": {**REPLICA_ENV, **(env or {})}},
        # Replicas log warnings and errors, not every call (access logs cost CPU at load).
        "logging_config": {"log_level": "WARNING", "enable_access_log": False},
    }
    sizes = fixed_sizes(cfg)
    if sizes:
        app["deployments"] = [{"name": name, "num_replicas": n} for name, n in sizes.items()]
    if cfg.scaled_pools("goodput"):
        app["autoscaling_policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": {"config": carried}}
    return {
        "http_options": {"host": cfg.gateway.host, "port": cfg.gateway.port},
        "applications": [app],
    }


def fixed_sizes(cfg: ClusterConfig) -> dict[str, int]:
    """Replicas of each fixed-size pool, by deployment name."""
    return {name: pool.replicas for name, pool in cfg.scaled_pools("fixed").items()}


def without_fixed_sizes(cfg: ClusterConfig) -> ClusterConfig:
    """`cfg` with each fixed pool at the default `replicas` (its size goes to Serve apart)."""
    default = PoolConfig.model_fields["replicas"].default
    return cfg.model_copy(update={name: pool.model_copy(update={"replicas": default})
                                  for name, pool in cfg.scaled_pools("fixed").items()})


def portable_config(cfg: ClusterConfig) -> dict:
    """The cluster config as JSON (what differs from the defaults) with nothing only
    this machine can resolve: capacity profiles travel as their numbers, not paths."""
    inlined = {}
    for name, pool in cfg.pools().items():
        if pool.autoscaling is not None and isinstance(pool.autoscaling.profile, str):
            scaling = pool.autoscaling.model_copy(update={"profile": pool.autoscaling.load_profile()})
            inlined[name] = pool.model_copy(update={"autoscaling": scaling})
    return cfg.model_copy(update=inlined).model_dump(mode="json", exclude_defaults=True)


def deploy(cfg: ClusterConfig, timeout_s: float = 300.0) -> dict:
    """Apply `cfg`'s Serve config to the running Serve instance (as `serve deploy`
    would, without the dashboard) and wait until the app runs it. Returns the config."""
    env = {KEYS_ENV: os.environ[KEYS_ENV]} if os.environ.get(KEYS_ENV) else {}
    root = model_cache.cache_root()
    if os.environ.get(model_cache.CACHE_ENV):  # the replicas' converted model copies go where this shell says
        env[model_cache.CACHE_ENV] = str(root) if root is not None else "off"
    return deploy_config(serve_config(cfg, env or None), timeout_s)


def cluster_config_of(config: dict) -> ClusterConfig:
    """The cluster config a generated Serve config (or a chart's serveConfigV2) deploys."""
    apps = [a for a in config.get("applications", []) if a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"expected one application with import_path {IMPORT_PATH}, found {len(apps)}")
    cfg = ClusterConfig.model_validate(apps[0].get("args", {}).get("config", {}))
    sizes = {d["name"]: d["num_replicas"] for d in apps[0].get("deployments", []) if "num_replicas" in d}
    pools = cfg.scaled_pools("fixed")
    return cfg.model_copy(update={name: pools[name].model_copy(update={"replicas": n})
                                  for name, n in sizes.items() if name in pools})


def deploy_config(config: dict, timeout_s: float = 300.0) -> dict:
    """Apply a Serve config (`ServeDeploySchema`) and wait until the app runs it: the
    old replicas replaced, or the deploy failed (raised with Serve's message)."""
    import time

    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ApplicationStatus, ServeDeploySchema

    # The controller marks the app DEPLOYING before this returns: RUNNING after it
    # means the new config's replicas, not the old ones.
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == ApplicationStatus.RUNNING:
            return config
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"Serve could not deploy {APP_NAME}: {app.status.value}: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{APP_NAME} was not running {timeout_s:.0f} s after deploy "
                               f"({app.status.value if app else 'absent'})")
        time.sleep(0.5)
