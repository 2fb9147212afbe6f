"""What every pool replica shares: building its engine from the cluster config,
and its identity inside Ray Serve."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from cluster.config import ClusterConfig, PoolConfig
from engine.async_engine import AsyncEngine
from engine.config import Role
from engine.engine import Engine
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def replica_id() -> str:
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"{ctx.deployment}#{ctx.replica_id.unique_id}"
    except Exception:  # outside Serve (tests, scripts)
        return f"local-{os.getpid()}"


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def start_engine(cfg: ClusterConfig, pool: PoolConfig, role: Role) -> AsyncEngine:
    """The pool's engine on its own thread, warmed up: /ready means one request ran."""
    # Ray sets OMP_NUM_THREADS=1 in actors; the pool config decides instead.
    torch.set_num_threads(pool.threads)
    ecfg = cfg.engine.engine_config(pool.threads)
    if pool.num_kv_blocks is not None:
        ecfg = dataclasses.replace(ecfg, num_kv_blocks=pool.num_kv_blocks)
    engine = Engine(ecfg, role=role)
    aengine = AsyncEngine(engine)
    aengine.submit(lambda: warm_up(engine)).result()
    return aengine


def warm_up(engine: Engine) -> None:
    """One tiny request through the whole step path before the replica reports ready."""
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0), request_id="warmup")
    while engine.has_unfinished():
        engine.step()
    export = engine.take_export(rid)
    if export is not None:
        engine.release_blocks(export.block_ids)
    engine.block_pool.reset_prefix_cache()
