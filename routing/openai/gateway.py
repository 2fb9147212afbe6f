"""The OpenAI-compatible gateway: FastAPI ingress of the Serve application.

It validates, renders the chat template, tokenizes (off the pools' engine loops),
checks the context length, and runs the request's pipeline (routing/openai/pipeline.py),
streaming SSE chunks as output batches arrive. Errors are OpenAI-format JSON with
the right status; an error after streaming began is sent as a final SSE event.
"""


import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from ray import serve

from autoscaling.config import SLOConfig
from autoscaling.signals import GatewaySignals
from engine.config import EngineConfig
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import served_model_name
from kvtransfer.replica import replica_id
from routing.openai import pipeline
from routing.openai.access import APIKeys, KeyLimiter, check_headers, read_body
from routing.openai.metrics import GatewayMetrics
from routing.openai.openapi import publish_request_schemas, request_body
from routing.openai.errors import APIError, install_error_handlers, internal_error, model_not_found, overloaded
from routing.openai.errors import invalid_request, not_ready
from routing.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, parse_request
from routing.openai.protocol import make_response_id
from routing.openai.stream import ChatStream, CompletionStream, build_chat_response, build_completion_response
from routing.openai.config import GatewayConfig
from routing.openai.stream import sse_error
from telemetry import metrics, tracing
from telemetry.config import TelemetryConfig
from telemetry.tracing import Context, SpanKind

log = logging.getLogger(__name__)

def _upstream_error(e: pipeline.UpstreamError) -> APIError:
    return not_ready(str(e), retry_after_s=1) if e.capacity else internal_error(str(e))


app = FastAPI(title="duet", description="OpenAI-compatible gateway of a disaggregated LLM cluster")
install_error_handlers(app)
publish_request_schemas(app, (ChatCompletionRequest, CompletionRequest))


# Module helpers the routes call must be defined above the class: `serve.ingress`
# freezes the FastAPI app (and the globals its routes see) when the class is decorated.
def _session(request: Request) -> str | None:
    """`x-session-id`: a session-affinity hint for the prefill router, never a rule."""
    return request.headers.get("x-session-id") or None


def _trace_parent(request: Request) -> Context | None:
    """The client's W3C trace context: its request becomes part of the client's trace."""
    return tracing.context_from_headers(request.headers)


# gen_ai.operation.name of each endpoint (OpenTelemetry GenAI semantic conventions).
_OPERATION = {"chat": "chat", "completions": "text_completion"}


def _request_attributes(call: "_Call") -> dict:
    sp = call.sampling
    return {
        "gen_ai.operation.name": _OPERATION[call.endpoint],
        "gen_ai.request.model": call.model,
        "gen_ai.response.model": call.model,
        "gen_ai.response.id": call.request_id,
        "gen_ai.request.max_tokens": sp.max_tokens,
        "gen_ai.request.temperature": sp.temperature,
        "gen_ai.request.top_p": sp.top_p,
        "gen_ai.request.seed": sp.seed,
        "duet.request_id": call.request_id,
    }


@dataclass(frozen=True)
class _Call:
    """One generation request as the gateway runs it."""

    endpoint: str
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    session: str | None  # `x-session-id`: an affinity hint for the prefill router
    key: str  # the caller's API key id
    model: str  # the served model name
    trace_parent: Context | None = None  # the client's `traceparent`, if it sent one

    @property
    def cost(self) -> int:
        """What it may use of its key's token budget: prompt + max_tokens."""
        return len(self.prompt_ids) + self.sampling.max_tokens


@serve.deployment(name="gateway")
@serve.ingress(app)
class Gateway:
    """Owns the HTTP surface, the tokenizer and the handles to the pools."""

    def __init__(
        self, gateway: dict, engine: dict, prefill=None, decode=None, aggregated=None, telemetry: dict | None = None,
        slo: dict | None = None,
    ):
        """`gateway`, `engine`, `telemetry` and `slo` are a dumped `GatewayConfig`, the
        pools' `EngineConfig`, a `TelemetryConfig` and an `SLOConfig`; `aggregated` set
        means aggregated mode, else `prefill` and `decode` are the pools."""
        self.cfg = GatewayConfig.model_validate(gateway)
        self.engine_cfg = EngineConfig.model_validate(engine)
        self.mode = "aggregated" if aggregated is not None else "disaggregated"
        self.model_name = served_model_name(self.engine_cfg)
        self.max_model_len = self.engine_cfg.max_model_len
        self.tokenizer = load_tokenizer(self.engine_cfg.model)
        self.prefill, self.decode, self.aggregated = prefill, decode, aggregated
        tracing.setup_tracing(TelemetryConfig.model_validate(telemetry or {}), "gateway")
        self.metrics = GatewayMetrics(replica_id())
        self.record = self.metrics.recorder
        slo_cfg = SLOConfig.model_validate(slo or {})
        self.signals = GatewaySignals(slo_cfg.ttft_ms, slo_cfg.tpot_ms, quantile=slo_cfg.goodput_target)
        self.keys = APIKeys.load(self.cfg.api_keys_file)
        self.resilience = pipeline.Resilience(self.cfg.max_migrations, self.cfg.prefill_retries)
        self.limiter = KeyLimiter(self.cfg.max_in_flight_per_key, self.cfg.tokens_per_minute_per_key)
        self.in_flight = 0
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
        """End-to-end latencies, goodput and arrivals for the autoscaling policy
        (read by Serve every `metrics_interval_s`)."""
        self.signals.in_flight = self.in_flight
        return self.signals.report()

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
                self.metrics.observe_pool(pool, stats)
        except Exception as e:
            log.warning("pool stats unavailable for /metrics: %s", e)
        return PlainTextResponse(generate_latest(self.metrics.registry).decode())

    async def _pool_stats(self) -> dict[str, dict]:
        pools = {"prefill": self.prefill, "decode": self.decode, "aggregated": self.aggregated}
        out = {}
        for name, handle in pools.items():
            if handle is not None:
                out[name] = await handle.stats.remote()
        return out

    @app.get("/v1/models")
    async def models(self, request: Request):
        self.keys.authenticate(request.headers.get("authorization"))
        card = ModelCard(id=self.model_name, root=self.engine_cfg.model, max_model_len=self.max_model_len)
        return ModelList(data=[card]).model_dump()

    # ------------------------------------------------------------ generation
    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat(self, request: Request):
        key, req = await self._accept(request, ChatCompletionRequest)
        try:
            text = self.tokenizer.apply_chat_template(req.template_messages(), req.add_generation_prompt)
        except Exception as e:
            raise invalid_request(f"messages could not be rendered with the chat template: {e}", "messages") from e
        ids = await asyncio.to_thread(self.tokenizer.encode, text)
        sp = req.to_sampling_params(len(ids), self.max_model_len, self.cfg.max_tokens)
        call = _Call(
            "chat", make_response_id("chat"), ids, sp, _session(request), key, self.model_name, _trace_parent(request)
        )
        self._admit(call)
        if req.stream:
            builder = ChatStream(
                call.request_id, self.model_name, include_usage=req.include_usage, logprobs=req.logprobs,
                token_text=self._token_text,
            )
            return self._stream(call, builder)
        outs = await self._collect(call)
        resp = build_chat_response(
            call.request_id, self.model_name, outs, logprobs=req.logprobs, token_text=self._token_text
        )
        return resp.model_dump(exclude_none=True)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(self, request: Request):
        key, req = await self._accept(request, CompletionRequest)
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt)
        else:
            ids = list(req.prompt)
            if max(ids) >= self.tokenizer.vocab_size:
                raise invalid_request(f"token ids must be < {self.tokenizer.vocab_size}", "prompt")
        if not ids:
            raise invalid_request("prompt must not be empty", "prompt")
        sp = req.to_sampling_params(len(ids), self.max_model_len, self.cfg.max_tokens)
        call = _Call(
            "completions", make_response_id("completion"), ids, sp, _session(request), key, self.model_name,
            _trace_parent(request),
        )
        self._admit(call)
        logprobs = req.logprobs is not None
        if req.stream:
            builder = CompletionStream(
                call.request_id, self.model_name, include_usage=req.include_usage, logprobs=logprobs,
                token_text=self._token_text,
            )
            return self._stream(call, builder)
        outs = await self._collect(call)
        resp = build_completion_response(
            call.request_id, self.model_name, outs, logprobs=logprobs, token_text=self._token_text
        )
        return resp.model_dump(exclude_none=True)

    async def _accept(self, request: Request, model_cls):
        """(the caller's key id, the parsed request): 431, 401, 413, 400 or 404 otherwise."""
        check_headers(request.headers.raw, self.cfg.max_header_bytes, self.cfg.max_headers)
        key = self.keys.authenticate(request.headers.get("authorization"))
        req = parse_request(model_cls, await read_body(request, self.cfg.max_body_bytes))
        self._check_model(req.model)
        return key, req

    def _check_model(self, model: str | None) -> None:
        if model and model not in (self.model_name, self.engine_cfg.model):
            raise model_not_found(model)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens([token_id])[0]

    def _admit(self, call: _Call) -> None:
        """Refuse with a 429 before any work (and before a stream's 200): the gateway's
        queue is full, the key has no request slot, or not enough of its token budget."""
        self._check_capacity()
        self.limiter.check(call.key)
        self.limiter.charge(call.key, call.cost)

    def _check_capacity(self) -> None:
        if self.in_flight >= self.cfg.max_pending_requests:
            raise overloaded(f"{self.in_flight} requests in flight; retry later")

    def _run(self, call: _Call, timing: pipeline.Timing, trace: dict | None):
        if self.aggregated is not None:
            return pipeline.aggregated(self.aggregated, call.request_id, call.prompt_ids, call.sampling, timing, trace)
        return pipeline.disaggregated(
            self.prefill, self.decode, call.request_id, call.prompt_ids, call.sampling, timing, call.session, trace,
            self.resilience,
        )

    async def _observed(self, call: _Call):
        """The pipeline's batches, with latency metrics, in-flight accounting and the
        request's SERVER span (the root of its trace, or a child of the client's)."""
        self._check_capacity()
        self.limiter.acquire(call.key)
        self.in_flight += 1
        self.record.set(metrics.IN_FLIGHT, self.in_flight)
        self.signals.arrived(len(call.prompt_ids))
        timing = pipeline.Timing()
        span = tracing.NO_SPAN
        if tracing.enabled():  # off: not even the attributes are built
            span = tracing.start_span(
                f"{_OPERATION[call.endpoint]} {call.model}", call.trace_parent, SpanKind.SERVER, _request_attributes(call)
            )
        last = first = None
        n_out = 0
        usage: RequestOutput | None = None
        finish = None
        status, error = "error", None
        try:
            async for outs in pipeline.within(self._run(call, timing, tracing.carrier(span)), self.cfg.request_timeout_s):
                now = time.monotonic()
                if last is None:
                    first = now
                    self.record.observe(metrics.TTFT, now - timing.start)
                    self.record.inc(metrics.PROMPT_TOKENS, outs[0].num_prompt_tokens)
                    self.record.inc(metrics.CACHED_TOKENS, outs[0].num_cached_tokens)
                    usage = outs[0]
                else:
                    self.record.observe(metrics.ITL, now - last)
                last = now
                n_out += sum(len(o.new_token_ids) for o in outs)
                finish = outs[-1].finish_reason or finish
                yield outs
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            self.limiter.release(call.key)
            self.in_flight -= 1
            self.record.set(metrics.IN_FLIGHT, self.in_flight)
            self.record.inc(metrics.REQUESTS, endpoint=call.endpoint, status=status)
            self.record.inc(metrics.OUTPUT_TOKENS, n_out)
            self.record.inc(metrics.MIGRATIONS, timing.migrations)
            self.record.inc(metrics.PREFILL_RETRIES, timing.prefill_retries)
            end = time.monotonic()
            self.record.observe(metrics.E2E, end - timing.start)
            tpot = None
            if status == "ok" and n_out > 1 and first is not None and last is not None:
                tpot = (last - first) / (n_out - 1)
                self.record.observe(metrics.TPOT, tpot)
            if status != "cancelled":  # a client that left says nothing of the SLO
                self.signals.finished(None if first is None else first - timing.start, tpot, ok=status == "ok")
                if (goodput := self.signals.goodput()) is not None:
                    self.record.set(metrics.GOODPUT, goodput)
            if span is not tracing.NO_SPAN:
                tracing.set_attributes(span, {
                    "gen_ai.usage.input_tokens": usage.num_prompt_tokens if usage else len(call.prompt_ids),
                    "gen_ai.usage.cache_read.input_tokens": usage.num_cached_tokens if usage else None,
                    "gen_ai.usage.output_tokens": n_out,
                    "gen_ai.response.finish_reasons": [finish.value] if finish is not None else None,
                    "duet.status": status,
                    "duet.ttft_ms": None if first is None else round((first - timing.start) * 1e3, 3),
                    "duet.tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
                    "duet.e2e_ms": round((end - timing.start) * 1e3, 3),
                    "duet.migrations": timing.migrations,
                    "duet.prefill_retries": timing.prefill_retries,
                })
                tracing.end_span(span, error)

    async def _collect(self, call: _Call):
        outs = []
        try:
            async for batch in self._observed(call):
                outs.extend(batch)
        except pipeline.UpstreamError as e:
            raise _upstream_error(e) from e
        return outs

    def _stream(self, call: _Call, builder) -> StreamingResponse:
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
