"""A whole `bench serve` run: every sweep point against one server, turned into
report point objects. Shared by the CLI and the planner's validation run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadgen.arrivals import ArrivalProcess
from loadgen.client import OpenAIClient
from loadgen.metrics import SLO, compute_metrics
from loadgen.prompts import PromptBuilder
from loadgen.report import point_report, request_rows
from loadgen.runner import run_point
from loadgen.tokenizer import TokenizerLike, count_tokens
from loadgen.workloads import WARMUP_VARIANT, WorkloadSpec, build_sessions


@dataclass
class BenchConfig:
    """Where to send, what, and how; validated by the objects it holds."""

    base_url: str
    model: str | None
    endpoint: str
    workload: WorkloadSpec
    arrivals: list[ArrivalProcess]
    slo: SLO = field(default_factory=SLO)
    warmup: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True
    same_prompts: bool = False  # every point sends the same prompt words (a warm prefix cache)
    transport: Any = None  # an httpx transport; tests pass an in-process fake server


def _first_model(server: dict[str, Any]) -> str | None:
    try:
        return server["models"]["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        return None


async def run_sweep(cfg: BenchConfig, tokenizer: TokenizerLike, log=print) -> list[dict[str, Any]]:
    """Run every sweep point and return point objects. Points get the same lengths
    but, unless `same_prompts`, their own prompt words (see build_sessions)."""
    builder = PromptBuilder(tokenizer)
    warmup_sessions = build_sessions(cfg.workload, builder, WARMUP_VARIANT) if cfg.warmup else None
    points = []
    probe = OpenAIClient(cfg.base_url, cfg.model or "", cfg.endpoint, cfg.timeout_s, cfg.api_key,
                         transport=cfg.transport)
    async with probe:
        server = await probe.server_info()
    model = cfg.model or _first_model(server)
    if not model:
        raise ValueError(f"--model not given and GET /v1/models at {cfg.base_url} named none: {server}")
    for i, arrival in enumerate(cfg.arrivals):
        sessions = build_sessions(cfg.workload, builder, 0 if cfg.same_prompts else i)
        # A fresh client per point: no connection state leaks between points.
        async with OpenAIClient(cfg.base_url, model, cfg.endpoint, cfg.timeout_s, cfg.api_key,
                                transport=cfg.transport) as client:
            run = await run_point(client, sessions, arrival, tokenizer, cfg.workload.ignore_eos,
                                  cfg.warmup, cfg.progress, warmup_sessions)
        metrics, per = compute_metrics(run.results, run.duration_s, lambda t: count_tokens(tokenizer, t), cfg.slo)
        info = {"model": model, "endpoint": cfg.endpoint, "started_at": run.started_at,
                "warmup_requests": cfg.warmup, "timeout_s": cfg.timeout_s,
                "prompt_variant": 0 if cfg.same_prompts else i}
        points.append(point_report(arrival, metrics, request_rows(run.results, per, run.t0),
                                   cfg.workload.describe(), server, info))
        good = "" if metrics.goodput is None else f", goodput {metrics.goodput:.2f} req/s ({metrics.goodput_ratio:.0%})"
        ttft = metrics.ttft_ms["median"]
        log(f"[{arrival.label}] {metrics.completed}/{metrics.submitted} completed "
            f"({metrics.failed} failed, {metrics.unfinished} unfinished) in {metrics.duration_s:.1f}s: "
            f"{metrics.request_throughput:.2f} req/s, {metrics.output_throughput:.1f} out tok/s, "
            f"TTFT p50 {'–' if ttft is None else f'{ttft:.0f}'} ms{good}")
    return points
