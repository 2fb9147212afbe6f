"""The ingress request router: which ingress replica HAProxy hands a request to.

Each replica that decodes (aggregated, or decode in P/D mode) runs the gateway and is
the HTTP ingress itself, so the replica that makes a request's tokens streams them.
With `gateway.ingress: haproxy` (Serve's HAProxy ingress, the default), HAProxy
forwards each connection straight to one such replica's own HTTP server. Before it
forwards a POST, it asks this deployment where to send it: `POST /internal/route`,
carrying the request's body (`RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`, which
`duet serve` and the chart set), its `x-session-id` and `x-request-id`, and nothing
else: no path, no Authorization. The answer names one replica; HAProxy pins the
request to it.

This renders the body's prompt exactly as the gateway will (routing/openai/prompts.py)
and asks the pool's own KV-aware router to choose, through a handle in this process
(from the deployment's request router config), as it chooses where a prompt is
prefilled and decoded (`generate(PrefillRequest)`): the replica holding the prompt's
longest cached prefix (from the replicas' KV events: an aggregated pool's always, a
decode pool's unless `router.disaggregation.mode` is `always`), else the least loaded
(sequences running, KV blocks free). It only picks; HAProxy sends the request, so the
router counts a pick as load for a short window, after which the replica's own
reports count it (serve_routers.PICK_ONLY). Its answer also tells the chosen replica
why, in a header HAProxy sets on the request (`ROUTE_HEADER`: the decision's reason,
the prefix blocks it holds and its cost there), which the gateway there puts on the request's span.

What it cannot see it does not guess. A body it cannot read as a completion or chat
request, or one the gateway will refuse, is routed by load alone, and the replica
answers the 400: a non-200 answer here would reach the client as HAProxy's 503. Under
`gateway.cache_isolation: per_key` a prompt's blocks are hashed under the caller's key,
which this router never sees, so it routes by load alone too.

Serve runs one replica of it per node that runs HAProxy, with no CPUs of its own
(Serve's rule for an ingress request router); each keeps its own view of the pool.
The hook is Ray 2.60's private `Application._with_ingress_request_router`
(cluster/app.py); docs/direct_streaming.md has the research behind it.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations
# (`request: Request`) as types, and Serve's class ingress cannot resolve them as strings.
import itertools
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from kvtransfer.messages import PrefillRequest
from routing.openai.access import cache_salt
from routing.openai.config import GatewayConfig
from routing.openai.prompts import Prompts
from routing.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from routing.router import view
from routing.router.serve_routers import PICK_ONLY

log = logging.getLogger("ray.serve")

# Set by HAProxy from this router's answer, e.g. "prefix 12 0.250": reason, prefix blocks, cost. HAProxy deletes any
# `x-serve-router-*` header a client sends to an app with an ingress request router.
ROUTE_HEADER = "x-serve-router-duet-route"



@dataclass(frozen=True)
class IngressRoute:
    """Why this router chose a replica, as it travels to that replica in `ROUTE_HEADER`
    ("prefix 12 0.250"): the decision's reason, the prompt's leading blocks the replica
    holds, and the decision's cost there."""

    reason: str
    cached_blocks: int
    cost: float

    def header(self) -> str:
        return f"{self.reason} {self.cached_blocks} {self.cost:.3f}"

    @classmethod
    def parse(cls, value: str | None) -> "IngressRoute | None":
        """The route a header names; None for a missing or malformed one."""
        parts = (value or "").split(" ")
        if len(parts) != 3 or not parts[0]:
            return None
        try:
            return cls(parts[0], int(parts[1]), float(parts[2]))
        except ValueError:
            return None


# A larger body is routed by load: tokenizing megabytes would outlast HAProxy's 5 s
# wait for this router's answer, and no prompt that long fits the model anyway.
_MAX_ROUTED_BODY_BYTES = 1 << 20

router_app = FastAPI()


@serve.ingress(router_app)
class IngressRouter:
    """Answers HAProxy's `POST /internal/route` with the replica of `pool` (the
    ingress deployment's handle: decode, or aggregated) that should take the request."""

    def __init__(self, pool: DeploymentHandle, engine: dict, gateway: dict):
        """`engine` and `gateway` are the dumped `EngineConfig` and `GatewayConfig` the
        pool's gateways run with, so the prompt renders the same here."""
        self.cfg = GatewayConfig.model_validate(gateway)
        self.prompts = Prompts(EngineConfig.model_validate(engine), self.cfg)
        # The call the pool's router decides on: `generate(PrefillRequest)`; the pool's
        # deployment is named after it ("aggregated", "decode"), as its router is.
        self.pool = pool.options(method_name="generate")
        self.pool_name = pool.deployment_name
        self._ids = itertools.count()
        self.unread = 0  # bodies routed by load because they could not be read

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> dict:
        read = None
        if self.cfg.cache_isolation != "per_key":  # else the blocks are keyed by a caller it cannot see
            read = await self._read(await request.body())
            self.unread += read is None
            if read is None and self.unread == 1:
                log.warning("ingress request router: a request body could not be read as a completion or chat "
                            "request; such requests are routed by load")
        prompt, salt = read or ((), None)
        message = PrefillRequest(f"route-{next(self._ids)}", tuple(prompt), SamplingParams(),
                                 session_id=request.headers.get("x-session-id"), cache_salt=salt)
        async with self.pool.choose_replica(message, _reserve=False, **{PICK_ONLY: True}) as selection:
            answer: dict = {"replica_id": selection._replica.replica_id.to_full_id_str()}
        decision = view.take_pick(self.pool_name, selection._request_metadata.internal_request_id)
        if decision is not None:
            route = IngressRoute(decision.reason, decision.cached_blocks, decision.cost)
            answer["request_headers"] = {ROUTE_HEADER: route.header()}
        return answer

    @router_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    async def _read(self, body: bytes) -> tuple[list[int], str | None] | None:
        """The prompt's token ids as the gateway will render them, and its KV namespace;
        None when the body is not a request the gateway would run (the replica will say
        why: this router must answer 200 whatever the body)."""
        if len(body) > _MAX_ROUTED_BODY_BYTES:
            return None
        try:
            fields = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(fields, dict):
            return None
        try:
            if "messages" in fields:
                chat = parse_request(ChatCompletionRequest, body)
                return await self.prompts.chat_ids(chat), cache_salt("none", "", chat.cache_salt)
            if "prompt" in fields:
                completion = parse_request(CompletionRequest, body)
                return await self.prompts.completion_ids(completion), cache_salt("none", "", completion.cache_salt)
        except Exception:  # APIError (a 400 the gateway gives), or anything else the body trips
            return None
        return None
