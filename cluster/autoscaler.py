"""The goodput policy inside Ray Serve: an application-level autoscaling policy.

Serve's controller calls `GoodputAutoscaler` (configured from the generated Serve
config's `autoscaling_policy.policy_kwargs`: the cluster config) on every
control-loop tick with the autoscaling context of each deployment of the app:
replicas running and asked for, and what each replica's `record_autoscaling_stats()`
last reported. It turns those into the pure policy's view (autoscaling/policy.py), returns each pool's replica
count, and records the decision as metrics. The end-to-end latencies come from the
ingress deployment (the replicas that decode, each with the gateway inside): every
replica reports its own requests, merged here (`merge_ingress_reports`). A pool with `policy: queue` gets Serve's
own rule here (an app-level policy replaces the deployments' own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from autoscaling.config import BudgetConfig, SLOConfig
from autoscaling.policy import GoodputPolicy, PoolPolicy, PoolState
from autoscaling.signals import ReplicaReport, merge_ingress_reports
from cluster.pools import INGRESS_POOL, POOLS_BY_MODE, PoolConfig
from telemetry import metrics

# The controller's own logger: decisions land in its log (logs/serve/controller_*.log).
log = logging.getLogger("ray.serve")


class GoodputAutoscaler:
    """Serve's application-level policy: `__call__(contexts) -> (replicas, state)`.

    `config` is the cluster config as the Serve config carries it (profiles inline).
    Only the pools, `slo:` and `budget:` are read, with their own models: the
    controller does not import the engine (torch) for the rest."""

    def __init__(self, config: dict) -> None:
        goodput, self.queue_pools = {}, set()
        mode = config.get("mode", "disaggregated")
        self.ingress = INGRESS_POOL[mode]
        for name in POOLS_BY_MODE[mode]:
            pool = PoolConfig.model_validate(config.get(name) or {})
            if pool.scaling == "queue":
                self.queue_pools.add(name)
            elif pool.scaling == "goodput":
                a = pool.autoscaling
                goodput[name] = PoolPolicy(name, a, a.load_profile(), pool.num_cpus, pool.num_gpus)
        slo = self.slo = SLOConfig.model_validate(config.get("slo") or {})
        budget = BudgetConfig.model_validate(config.get("budget") or {})
        self.policy = GoodputPolicy(goodput, slo, budget)
        self._first_seen: dict[str, float] = {}
        self._recorder: metrics.Recorder | None = None
        self._last_reasons: dict[str, tuple[int, str]] = {}

    def __call__(self, contexts: Mapping) -> tuple[dict, dict]:
        now = time.monotonic()
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        gateway = self._ingress_view(by_name.get(self.ingress, (None, None))[1])
        states = {name: self._pool_state(ctx, now) for name, (_, ctx) in by_name.items() if name in self.policy.pools}
        running = {r.replica_id for st in states.values() for r in st.replicas}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in running}  # replicas gone
        decisions = self.policy.decide(now, states, gateway)
        out = {by_name[name][0]: d.desired for name, d in decisions.items()}
        for name in self.queue_pools & by_name.keys():
            dep_id, ctx = by_name[name]
            out[dep_id] = _serve_queue_rule(ctx)
        self._record(decisions)
        return out, {}

    def _pool_state(self, ctx, now: float) -> PoolState:
        values = _per_replica(ctx)
        reports = []
        for rid in ctx.running_replicas:
            key = rid.unique_id
            first = self._first_seen.setdefault(key, now)
            reports.append(ReplicaReport(key, now - first, values.get(key, {})))
        return PoolState(ctx.target_num_replicas, tuple(reports))

    def _ingress_view(self, ctx) -> dict[str, float]:
        """The ingress replicas' end-to-end reports merged: rates add up, the tails are
        the quantiles of the union of their samples."""
        if ctx is None:
            return {}
        return merge_ingress_reports(list(_per_replica(ctx).values()), self.slo.goodput_target)

    def _record(self, decisions) -> None:
        if self._recorder is None:
            self._recorder = metrics.Recorder("autoscaler", "controller")
        for name, d in decisions.items():
            self._recorder.set(metrics.AUTOSCALE_DESIRED, d.desired, pool=name)
            self._recorder.set(metrics.AUTOSCALE_CURRENT, d.current, pool=name)
            if d.desired != d.current:
                self._recorder.inc(metrics.AUTOSCALE_DECISIONS, pool=name, direction=d.direction, reason=d.reason)
                log.info("duet autoscale %s: %d -> %d (%s: %s)", name, d.current, d.desired, d.reason, d.detail)
            elif self._last_reasons.get(name) != (d.current, d.reason):  # a hold: once per new reason
                log.info("duet autoscale %s: hold %d (%s: %s)", name, d.current, d.reason, d.detail)
            self._last_reasons[name] = (d.current, d.reason)


def _per_replica(ctx) -> dict[str, dict[str, float]]:
    """`{replica: {signal: value}}` from Serve's aggregated custom metrics."""
    out: dict[str, dict[str, float]] = {}
    for metric, by_replica in (ctx.aggregated_metrics or {}).items():
        for rid, value in by_replica.items():
            out.setdefault(rid.unique_id, {})[metric] = float(value)
    return out


def _serve_queue_rule(ctx) -> float:
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    replicas, _ = replica_queue_length_autoscaling_policy(ctx)
    return replicas
