"""The path of one request behind the gateway, as a stream of output batches.

Disaggregated: prefill → (first token to the client at once) → decode, which
imports the KV and streams the rest. Aggregated: one pool does both. Whatever ends
the stream early (client gone, replica dead) is handled here: in-flight Serve calls
are cancelled, and a lease nobody will pull is rejected so prefill frees it now
rather than at TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.handoff import reject_lease
from kvtransfer.messages import DecodeRequest, ImportFailed, PrefillResult, RejectReason

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """A pool failed the request: 503 when it was out of capacity (decode had no free
    KV blocks; retrying later can succeed), 500 otherwise (replica died, import failed)."""

    def __init__(self, message: str, capacity: bool = False):
        super().__init__(message)
        self.capacity = capacity


# A lease the gateway gives up is freed by its TTL anyway: never wait long to say so.
_REJECT_TIMEOUT_S = 1.0


@dataclass
class Timing:
    """When things happened for one request (monotonic seconds)."""

    start: float = field(default_factory=time.monotonic)
    prefill_done: float | None = None
    first_token: float | None = None


async def disaggregated(
    prefill_handle,
    decode_handle,
    request_id: str,
    prompt_ids: list[int],
    sp: SamplingParams,
    timing: Timing,
    session_id: str | None = None,
    trace: dict[str, str] | None = None,
) -> AsyncIterator[list[RequestOutput]]:
    """`session_id` is the router's affinity hint (routing/router/serve_routers.py);
    `trace` the W3C context both pools continue (telemetry/tracing.py)."""
    try:
        result: PrefillResult = await prefill_handle.prefill.remote(
            request_id, prompt_ids, sp, session_id=session_id, trace=trace
        )
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise UpstreamError(f"prefill failed: {_short(e)}") from e
    timing.prefill_done = time.monotonic()
    first = [
        RequestOutput(
            request_id=request_id,
            new_token_ids=[result.first_token],
            text=result.text,
            finished=result.finish_reason is not None,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
            num_output_tokens=1,
            logprobs=[result.first_token_logprobs] if result.first_token_logprobs else None,
        )
    ]
    if result.kv_handle is None:
        yield first
        return
    ended = False  # decode streamed the request to its end
    try:
        yield first
        req = DecodeRequest(request_id, tuple(prompt_ids), result.first_token, sp, result.kv_handle, trace)
        stream = decode_handle.options(stream=True).generate.remote(req)
        try:
            async for outs in stream:
                yield outs
            ended = True
        except (asyncio.CancelledError, GeneratorExit):
            stream.cancel()
            raise
        except Exception as e:
            raise UpstreamError(f"decode failed: {_short(e)}", capacity=_is_capacity(e)) from e
    finally:
        if not ended:
            # Nobody will use this lease now: free the prefill blocks at once rather than
            # at expiry. Decode may have ended it already (then this is a no-op), or may
            # still be pulling: its copy is discarded with the cancelled call, never cached.
            # Not awaited: a cancelled request's task is cancelled again at every await.
            asyncio.get_running_loop().run_in_executor(
                None, reject_lease, result.kv_handle, RejectReason.CLIENT_DISCONNECTED, _REJECT_TIMEOUT_S
            )


async def aggregated(
    handle, request_id: str, prompt_ids: list[int], sp: SamplingParams, timing: Timing, trace: dict | None = None
):
    stream = handle.options(stream=True).generate.remote(request_id, prompt_ids, sp, trace=trace)
    try:
        async for outs in stream:
            yield outs
    except (asyncio.CancelledError, GeneratorExit):
        stream.cancel()
        raise
    except Exception as e:
        raise UpstreamError(f"engine failed: {_short(e)}") from e


def _is_capacity(e: BaseException) -> bool:
    # Ray re-raises the replica's exception as a subclass of its type.
    return isinstance(e, ImportFailed) and e.reason == RejectReason.NO_FREE_BLOCKS


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:500]
