"""The OpenAI-compatible gateway: FastAPI ingress of the Serve application, inside
each replica that decodes (the decode pool in P/D mode, the aggregated pool otherwise),
which then streams the tokens its own engine makes.

It validates, renders the chat template, tokenizes (off the pools' engine loops),
checks the context length, and runs the request's pipeline (routing/openai/pipeline.py),
streaming SSE chunks as output batches arrive. Errors are OpenAI-format JSON with
the right status; an error after streaming began is sent as a final SSE event.
"""


import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from ray import serve

from autoscaling.config import SLOConfig
from autoscaling.placement import ClusterView, DisaggregationConfig
from autoscaling.signals import GatewaySignals
from engine.config import EngineConfig
from engine.weights import served_model_name
from kvtransfer.config import TransferConfig
from kvtransfer.messages import DecodeRequest, PrefillRequest
from kvtransfer.replica import replica_id
from routing.openai import pipeline
from routing.openai.access import APIKeys, KeyLimiter, cache_salt, check_headers, read_body
from routing.openai.config import GatewayConfig
from routing.openai.errors import (
    APIError,
    install_error_handlers,
    internal_error,
    invalid_request,
    model_not_found,
    not_ready,
)
from routing.openai.metrics import GatewayMetrics
from routing.openai.openapi import publish_request_schemas, request_body
from routing.openai.prompts import Prompts
from routing.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    make_response_id,
    parse_request,
)
from routing.openai.record import Admission, Call, RequestRecord
from routing.openai.stream import (
    ChatStream,
    ChoiceStreams,
    CompletionStream,
    best_of,
    build_chat_response,
    build_completion_response,
    merge_choices,
    sse_error,
)
from routing.router import view as router_view
from routing.router.ingress import ROUTE_HEADER, IngressRoute
from telemetry import metrics, tracing
from telemetry.config import TelemetryConfig
from telemetry.tracing import Context

if TYPE_CHECKING:  # imported where the replica builds its server: the gateway's modules never load torch
    from decode.aggregated import AggregatedServer
    from decode.server import DecodeServer

log = logging.getLogger(__name__)

def _upstream_error(e: pipeline.UpstreamError) -> APIError:
    return not_ready(str(e), retry_after_s=1) if e.capacity else internal_error(str(e))


app = FastAPI(title="duet", description="OpenAI-compatible gateway of a disaggregated LLM cluster")
install_error_handlers(app)
publish_request_schemas(app, (ChatCompletionRequest, CompletionRequest))


# Module helpers the routes call must be defined above the class: `serve.ingress`
# freezes the FastAPI app (and the globals its routes see) when the class is decorated.
def _session(request: Request, prompt_cache_key: str | None = None) -> str | None:
    """`x-session-id` (or the body's `prompt_cache_key`): a session-affinity hint for the
    prefill router, never a rule."""
    return request.headers.get("x-session-id") or prompt_cache_key or None


def _by_choice(call: Call, outs: list) -> list[list]:
    """A whole request's outputs split by choice, in choice order."""
    if call.n == 1:
        return [outs]
    ids = [call.choice_id(i) for i in range(call.n)]
    return [[o for o in outs if o.request_id == rid] for rid in ids]


def _own_deployment():
    """A handle to the deployment this replica belongs to (a decode replica's
    way to the others); asked at first use, from inside the replica."""
    ctx = serve.get_replica_context()
    return serve.get_deployment_handle(ctx.deployment, ctx.app_name)


def _trace_parent(request: Request) -> Context | None:
    """The client's W3C trace context: its request becomes part of the client's trace."""
    return tracing.context_from_headers(request.headers)


@serve.deployment(name="decode")
@serve.ingress(app)
class Gateway:
    """The HTTP ingress inside each replica that decodes: owns the HTTP surface, the
    tokenizer, and that replica's pool server (the engine that makes the tokens it
    streams), plus, in P/D mode, the handle to the prefill pool."""

    def __init__(
        self, gateway: dict, engine: dict, server: dict, prefill=None, telemetry: dict | None = None,
        slo: dict | None = None, disaggregation: dict | None = None,
        transfer_timeout_s: float = TransferConfig().timeout_s, ingress_routed: bool = False,
    ):
        """`gateway`, `engine`, `telemetry`, `slo` and `disaggregation` are a dumped
        `GatewayConfig`, the pools' `EngineConfig`, a `TelemetryConfig`, an `SLOConfig`
        and the router's `DisaggregationConfig`. `server` holds the arguments of the
        pool server this replica runs: an `AggregatedServer` (aggregated mode), or, with
        `prefill` (the prefill pool's handle), a `DecodeServer`; `transfer_timeout_s`
        bounds one KV pull (`transfer.timeout_s`).

        `ingress_routed` (`ClusterConfig.routes_at_ingress`): HAProxy asks the ingress
        request router which replica takes each request, and sets the router's answer
        as a header after it drops any copy a client sent."""
        self.cfg = GatewayConfig.model_validate(gateway)
        self.ingress_routed = ingress_routed
        self.engine_cfg = EngineConfig.model_validate(engine)
        self.mode = "disaggregated" if prefill is not None else "aggregated"
        role = "aggregated" if self.mode == "aggregated" else "decode"
        # One tracer provider a process: the replica's spans all say both jobs.
        tracing.setup_tracing(TelemetryConfig.model_validate(telemetry or {}), f"gateway+{role}")
        # Built first: a replica whose engine cannot start fails before it takes traffic.
        self.local: AggregatedServer | DecodeServer
        self.aggregated: AggregatedServer | None = None
        self.local_decode: DecodeServer | None = None
        self.decode: pipeline.DecodePools | None = None
        if role == "aggregated":
            from decode import aggregated as aggregated_server  # here: the gateway's modules never load torch

            self.local = self.aggregated = aggregated_server.AggregatedServer(**server)
        else:
            from decode import server as decode_server

            self.local = self.local_decode = decode_server.DecodeServer(**server)
            # What this replica's lost or draining engine leaves goes to the others.
            self.decode = pipeline.DecodePools(self.local_decode, pipeline.RemotePool(_own_deployment),
                                               self.local_decode.lost_replica)
        self.model_name = served_model_name(self.engine_cfg)
        self.max_model_len = self.engine_cfg.max_model_len
        self.prompts = Prompts(self.engine_cfg, self.cfg)
        self.tokenizer = self.prompts.tokenizer
        self.prefill = prefill
        # Not `self.metrics`: that name is the /metrics route below.
        self.gateway_metrics = GatewayMetrics(replica_id())
        self.record = self.gateway_metrics.recorder
        slo_cfg = SLOConfig.model_validate(slo or {})
        self.signals = GatewaySignals(slo_cfg.ttft_ms, slo_cfg.tpot_ms, quantile=slo_cfg.goodput_target)
        self.keys = APIKeys.load(self.cfg.api_keys_file)
        self.resilience = pipeline.Resilience(self.cfg.max_migrations, self.cfg.prefill_retries,
                                              pipeline.grace_after_lease(transfer_timeout_s),
                                              self.cfg.prefill_retry_wait_s)
        self.placement = DisaggregationConfig.model_validate(disaggregation or {})
        self.admission = Admission(
            KeyLimiter(self.cfg.max_in_flight_per_key, self.cfg.tokens_per_minute_per_key),
            self.cfg.max_pending_requests, lambda n: self.record.set(metrics.IN_FLIGHT, n),
        )
        self._ready = False
        if self.cfg.cors_allow_origins:
            # Before the first request builds the middleware stack (FastAPI refuses after).
            app.add_middleware(
                CORSMiddleware, allow_origins=list(self.cfg.cors_allow_origins), allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type", "x-session-id", "traceparent", "tracestate"],
            )
        if not self.keys.enabled:
            log.warning("gateway: no API keys configured (DUET_API_KEYS, gateway.api_keys_file): open to anyone")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For the autoscaling policy (read by Serve every `metrics_interval_s`): the
        pool replica's own signals and the end-to-end latencies, goodput and arrivals
        of the requests this replica took as the ingress (their names do not overlap)."""
        self.signals.in_flight = self.admission.in_flight
        return {**self.local.record_autoscaling_stats(), **self.signals.report()}

    def record_routing_stats(self) -> dict:
        """The pool replica's load and KV events, for the routers' KV-aware choice."""
        return self.local.record_routing_stats()

    # ------------------------------------------------------------ probes
    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self):
        try:
            await asyncio.wait_for(self._pool_stats(), timeout=5)
        except Exception as e:
            err = not_ready(f"pools not ready: {pipeline._short(e)}")
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        self._ready = True
        return {"status": "ready", "model": self.model_name, "mode": self.mode}

    @app.get("/metrics")
    async def metrics(self, request: Request):
        if self.cfg.metrics_require_key:
            self.keys.authenticate(request.headers.get("authorization"))
        try:
            for pool, stats in (await asyncio.wait_for(self._pool_stats(), timeout=2)).items():
                self.gateway_metrics.observe_pool(pool, stats)
        except Exception as e:
            log.warning("pool stats unavailable for /metrics: %s", e)
        self.gateway_metrics.observe_routers()
        return PlainTextResponse(generate_latest(self.gateway_metrics.registry).decode())

    async def _pool_stats(self) -> dict[str, dict]:
        if self.mode == "aggregated":
            return {"aggregated": await self.local.stats()}
        return {"prefill": await self.prefill.stats.remote(), "decode": await self.local.stats()}

    async def stats(self) -> dict:
        """This replica's pool server's stats (its deployment carries the pool's name),
        for operators and the tests."""
        return await self.local.stats()

    async def generate(self, req: DecodeRequest | PrefillRequest):
        """A decode replica's `generate` (decode/server.py), for the other replicas of
        its deployment: a pass migrated off them, or a sequence one hands on as it
        drains."""
        if self.local_decode is None:
            raise RuntimeError("generate(): only a decode replica takes passes from the others")
        async with contextlib.aclosing(self.local_decode.generate(req)) as items:
            async for item in items:
                yield item

    async def check_health(self) -> None:
        """Serve's health check: an engine that died fails it, and Serve replaces this replica."""
        await self.local.check_health()

    def __del__(self):
        """Serve calls this once the replica's calls have ended: the engine stops with it
        (its child process exits)."""
        local = getattr(self, "local", None)
        if local is not None:
            try:
                local.shutdown()
            except Exception:
                log.exception("gateway: stopping the replica's engine failed")

    @app.get("/v1/models")
    async def models(self, request: Request):
        self.keys.authenticate(request.headers.get("authorization"))
        card = ModelCard(id=self.model_name, root=self.engine_cfg.model, max_model_len=self.max_model_len)
        return ModelList(data=[card]).model_dump()

    # ------------------------------------------------------------ generation
    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat(self, request: Request):
        key, req = await self._accept(request, ChatCompletionRequest)
        ids = await self.prompts.chat_ids(req)
        # Off the event loop: a structured output's grammar is compiled to validate it.
        sp = await asyncio.to_thread(
            req.to_sampling_params, len(ids), self.max_model_len, self.cfg.max_tokens, self.tokenizer.vocab_size
        )
        call = Call(
            "chat", make_response_id("chat"), ids, sp, _session(request, req.prompt_cache_key), key, self.model_name,
            _trace_parent(request), self._choices(req.n), cache_salt(self.cfg.cache_isolation, key, req.cache_salt),
            self._ingress_route(request),
        )
        self.admission.check(call)
        tools = req.tool_use()
        if req.stream:
            return self._stream(call, ChoiceStreams({call.choice_id(i): ChatStream(
                call.request_id, self.model_name, include_usage=req.include_usage, logprobs=req.logprobs,
                token_text=self._token_text, tools=tools, index=i,
            ) for i in range(call.n)}))
        outs = await self._collect(call)
        resp = merge_choices([build_chat_response(
            call.request_id, self.model_name, choice, logprobs=req.logprobs, token_text=self._token_text, tools=tools,
        ) for choice in _by_choice(call, outs)])
        return resp.model_dump(exclude_none=True)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request):
        key, req = await self._accept(request, CompletionRequest)
        ids = await self.prompts.completion_ids(req)
        # Off the event loop: a structured output's grammar is compiled to validate it.
        sp = await asyncio.to_thread(
            req.to_sampling_params, len(ids), self.max_model_len, self.cfg.max_tokens, self.tokenizer.vocab_size
        )
        call = Call(
            "completions", make_response_id("completion"), ids, sp, _session(request), key, self.model_name,
            _trace_parent(request), self._choices(req.candidates, "best_of" if req.best_of else "n"),
            cache_salt(self.cfg.cache_isolation, key, req.cache_salt), self._ingress_route(request),
        )
        self.admission.check(call)
        logprobs = req.logprobs is not None
        if req.stream:
            return self._stream(call, ChoiceStreams({call.choice_id(i): CompletionStream(
                call.request_id, self.model_name, include_usage=req.include_usage, logprobs=logprobs,
                token_text=self._token_text, index=i,
            ) for i in range(call.n)}))
        outs = await self._collect(call)
        candidates = _by_choice(call, outs)
        responses = [build_completion_response(
            call.request_id, self.model_name, choice, logprobs=logprobs, token_text=self._token_text
        ) for choice in candidates]
        chosen = best_of(candidates, req.n) if call.n > req.n else range(call.n)
        return merge_choices([responses[i] for i in chosen], billed=responses).model_dump(exclude_none=True)

    async def _accept(self, request: Request, model_cls):
        """(the caller's key id, the parsed request): 431, 401, 413, 400 or 404 otherwise."""
        check_headers(request.headers.raw, self.cfg.max_header_bytes, self.cfg.max_headers)
        key = self.keys.authenticate(request.headers.get("authorization"))
        req = parse_request(model_cls, await read_body(request, self.cfg.max_body_bytes))
        self._check_model(req.model)
        return key, req

    def _choices(self, n: int, param: str = "n") -> int:
        """`n` sequences generated for one request (`n`, or `best_of` candidates)."""
        if n > self.cfg.max_n:
            raise invalid_request(f"{param}={n} is above this server's limit of {self.cfg.max_n}", param)
        return n

    def _check_model(self, model: str | None) -> None:
        if model and model not in (self.model_name, self.engine_cfg.model):
            raise model_not_found(model)

    def _ingress_route(self, request: Request) -> IngressRoute | None:
        """Why the ingress request router chose this replica, from the header HAProxy set
        (routing/router/ingress.py); None without one, or where no ingress request
        router stands in front: without one HAProxy passes a client's copy through."""
        return IngressRoute.parse(request.headers.get(ROUTE_HEADER)) if self.ingress_routed else None

    async def _cluster_view(self, req: PrefillRequest) -> ClusterView | None:
        """`router.disaggregation: auto`'s view: the prefill router's, and this replica's
        own (a first pass prefilled locally runs here)."""
        return await router_view.cluster_view(req, local=self.local_decode)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens([token_id])[0]

    def _run(self, call: Call, record: RequestRecord):
        def choice(req: PrefillRequest):
            if self.aggregated is not None:
                return pipeline.aggregated(self.aggregated, req)
            assert self.decode is not None
            return pipeline.disaggregated(self.prefill, self.decode, req, record.timing, self.resilience,
                                          self.placement, record.placed, self._cluster_view,
                                          lambda: router_view.has_replicas("prefill") is not False)

        reqs = [call.to_pool(record.trace, i) for i in range(call.n)]
        if call.n == 1:
            return choice(reqs[0])
        return pipeline.choices(choice, reqs, fork_after_tokens=1 if self.aggregated is not None else 2)

    async def _observed(self, call: Call):
        """The pipeline's batches, bracketed by the call's admission and recorded."""
        self.admission.enter(call)
        record = RequestRecord(call, self.record, self.signals)
        status, error = "error", None
        try:
            async for outs in pipeline.within(self._run(call, record), self.cfg.request_timeout_s):
                record.batch(outs)
                yield outs
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            self.admission.leave(call)
            record.close(status, error)

    async def _collect(self, call: Call):
        outs = []
        try:
            async for batch in self._observed(call):
                outs.extend(batch)
        except pipeline.UpstreamError as e:
            raise _upstream_error(e) from e
        return outs

    def _stream(self, call: Call, builder) -> StreamingResponse:
        async def body():
            try:
                async for outs in self._observed(call):
                    chunk = builder.chunk(outs)
                    if chunk:
                        yield chunk
                yield builder.done()
            except pipeline.UpstreamError as e:
                yield sse_error(_upstream_error(e))
            except APIError as e:
                yield sse_error(e)

        return StreamingResponse(body(), media_type="text/event-stream")
