"""One generation request as the gateway runs it: the call, its admission, and the
record that collects its timings and reports them once when it closes.

`Admission` is the one place that says whether a request may run (the replica's
queue bound, the key's request slots and token budget) and counts what runs.
`RequestRecord` sees every output batch pass and, when the request closes, emits the
latency metrics, the SLO signals and the request's SERVER span, each exactly once.
Neither reads HTTP: both run wherever a request's stream is served.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoscaling.placement import Placement
from autoscaling.signals import GatewaySignals
from engine.request import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.messages import PrefillRequest, TraceCarrier
from routing.openai.access import KeyLimiter
from routing.openai.errors import overloaded
from routing.openai.pipeline import Timing
from telemetry import metrics, tracing
from telemetry.tracing import Context, Span, SpanKind

if TYPE_CHECKING:
    from routing.router.ingress import IngressRoute

# gen_ai.operation.name of each endpoint (OpenTelemetry GenAI semantic conventions).
OPERATION = {"chat": "chat", "completions": "text_completion"}


@dataclass(frozen=True)
class Call:
    """One generation request, validated and tokenized."""

    endpoint: str
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    session: str | None  # `x-session-id`: an affinity hint for the prefill router
    key: str  # the caller's API key id
    model: str  # the served model name
    trace_parent: Context | None = None  # the client's `traceparent`, if it sent one
    n: int = 1  # choices: each one a sequence of its own in the pools
    cache_salt: str | None = None  # its KV namespace (routing/openai/access.py `cache_salt`)
    # Why the ingress request router sent it to this replica: (reason, prefix blocks held,
    # its cost there: sequences it counted running plus the KV charge, routing/router/policy.py).
    route: IngressRoute | None = None  # why the ingress request router chose this replica

    @property
    def cost(self) -> int:
        """What it may use of its key's token budget: prompt + n x max_tokens."""
        return len(self.prompt_ids) + self.n * self.sampling.max_tokens

    def choice_id(self, index: int) -> str:
        """The pools' request id of choice `index` (the call's own when n is 1)."""
        return self.request_id if self.n == 1 else f"{self.request_id}-{index}"

    def to_pool(self, trace: TraceCarrier | None, index: int = 0) -> PrefillRequest:
        """The message the pools receive for choice `index`. With a seed, choice i
        samples with seed + i (as vLLM does), so the choices differ yet repeat."""
        sp = self.sampling
        if index and sp.seed is not None:
            sp = dataclasses.replace(sp, seed=(sp.seed + index + 2**63) % 2**64 - 2**63)
        return PrefillRequest(self.choice_id(index), tuple(self.prompt_ids), sp, self.session, trace, self.cache_salt)


class Admission:
    """Owns whether a request may run: this replica's bound on requests in flight,
    and each key's request slots and token budget. `check` refuses (429) before any
    work, so a stream is refused before its 200; `enter` / `leave` bracket the run."""

    def __init__(self, limiter: KeyLimiter, max_pending: int, on_change: Callable[[int], None]) -> None:
        self.limiter = limiter
        self.max_pending = max_pending
        self.in_flight = 0
        self._on_change = on_change

    def check(self, call: Call) -> None:
        """429 if the replica's queue is full, the key has no request slot, or not
        enough of its token budget (which this charges)."""
        self._check_capacity()
        self.limiter.check(call.key)
        self.limiter.charge(call.key, call.cost)

    def enter(self, call: Call) -> None:
        """Take the request's slots (checked again: others may have run since `check`)."""
        self._check_capacity()
        self.limiter.acquire(call.key)
        self.in_flight += 1
        self._on_change(self.in_flight)

    def leave(self, call: Call) -> None:
        self.limiter.release(call.key)
        self.in_flight -= 1
        self._on_change(self.in_flight)

    def _check_capacity(self) -> None:
        if self.in_flight >= self.max_pending:
            raise overloaded(f"{self.in_flight} requests in flight; retry later")


class RequestRecord:
    """One request's timings and usage as its batches pass; `close` reports them once."""

    def __init__(self, call: Call, recorder: metrics.Recorder, signals: GatewaySignals) -> None:
        self.call = call
        self.timing = Timing()
        self._recorder = recorder
        self._signals = signals
        self.span: Span = tracing.NO_SPAN
        if tracing.enabled():  # off: not even the attributes are built
            self.span = tracing.start_span(
                f"{OPERATION[call.endpoint]} {call.model}", call.trace_parent, SpanKind.SERVER,
                _request_attributes(call),
            )
        self.first: float | None = None
        self.last: float | None = None
        self.num_output_tokens = 0
        self.usage: RequestOutput | None = None  # the first output: prompt and cached tokens
        self.finish: FinishReason | None = None
        self._closed = False
        signals.arrived(len(call.prompt_ids))

    @property
    def trace(self) -> TraceCarrier | None:
        """The context the pools continue: this request's span."""
        return tracing.carrier(self.span)

    def placed(self, placement: Placement) -> None:
        """Where a pass of the request computes its prompt (autoscaling/placement.py)."""
        self._recorder.inc(metrics.PLACEMENTS, where=placement.where.value, reason=placement.reason)
        tracing.set_attributes(self.span, {"duet.disaggregation.where": placement.where.value,
                                           "duet.disaggregation.reason": placement.reason,
                                           "duet.disaggregation.local_ms": placement.local_ms,
                                           "duet.disaggregation.remote_ms": placement.remote_ms})

    def batch(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        r = self._recorder
        if self.last is None:
            self.first = now
            r.observe(metrics.TTFT, now - self.timing.start)
            r.inc(metrics.PROMPT_TOKENS, outs[0].num_prompt_tokens)
            r.inc(metrics.CACHED_TOKENS, outs[0].num_cached_tokens)
            self.usage = outs[0]
        else:
            r.observe(metrics.ITL, now - self.last)
        self.last = now
        self.num_output_tokens += sum(len(o.new_token_ids) for o in outs)
        self.finish = outs[-1].finish_reason or self.finish

    def close(self, status: str, error: BaseException | None = None) -> None:
        """`status`: ok, error or cancelled (a client that left says nothing of the SLO)."""
        if self._closed:
            return
        self._closed = True
        r, t = self._recorder, self.timing
        end = time.monotonic()
        r.inc(metrics.REQUESTS, endpoint=self.call.endpoint, status=status)
        r.inc(metrics.OUTPUT_TOKENS, self.num_output_tokens)
        r.inc(metrics.MIGRATIONS, t.migrations)
        r.inc(metrics.MOVES, t.moves)
        r.inc(metrics.PREFILL_RETRIES, t.prefill_retries)
        r.observe(metrics.E2E, end - t.start)
        ttft = None if self.first is None else self.first - t.start
        tpot = None
        per_choice = self.num_output_tokens / self.call.n  # n choices advance side by side
        if status == "ok" and per_choice > 1 and self.first is not None and self.last is not None:
            tpot = (self.last - self.first) / (per_choice - 1)
            r.observe(metrics.TPOT, tpot)
        if status != "cancelled":
            self._signals.finished(ttft, tpot, ok=status == "ok")
            if (goodput := self._signals.goodput()) is not None:
                r.set(metrics.GOODPUT, goodput)
        if self.span is tracing.NO_SPAN:
            return
        usage = self.usage
        tracing.set_attributes(self.span, {
            "gen_ai.usage.input_tokens": usage.num_prompt_tokens if usage else len(self.call.prompt_ids),
            "gen_ai.usage.cache_read.input_tokens": usage.num_cached_tokens if usage else None,
            "gen_ai.usage.output_tokens": self.num_output_tokens,
            "gen_ai.response.finish_reasons": [self.finish.value] if self.finish is not None else None,
            "duet.status": status,
            "duet.ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
            "duet.tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
            "duet.e2e_ms": round((end - t.start) * 1e3, 3),
            "duet.migrations": t.migrations,
            "duet.moves": t.moves,
            "duet.prefill_retries": t.prefill_retries,
        })
        tracing.end_span(self.span, error)


def _request_attributes(call: Call) -> dict[str, Any]:
    sp = call.sampling
    return {
        "gen_ai.operation.name": OPERATION[call.endpoint],
        "gen_ai.request.model": call.model,
        "gen_ai.response.model": call.model,
        "gen_ai.response.id": call.request_id,
        "gen_ai.request.max_tokens": sp.max_tokens,
        "gen_ai.request.temperature": sp.temperature,
        "gen_ai.request.top_p": sp.top_p,
        "gen_ai.request.seed": sp.seed,
        "duet.request_id": call.request_id,
        **({"duet.route.by": "ingress", "duet.route.reason": call.route.reason,
            "duet.route.overlap_blocks": call.route.cached_blocks, "duet.route.cost": call.route.cost}
           if call.route is not None else {}),
    }
