"""What this process's routers know, for `router.disaggregation: auto` and the ingress router.

The gateway's pipeline places each pass of a request before it calls either pool
(autoscaling/placement.py). The numbers that price the two places live in the
KV-aware routers Serve runs in the same process: the prefill pool's queues and prefix
index, and the decode pool's batches, free blocks and prefix index (from the decode
replicas' KV events). Each router registers itself here when Serve gives it its
replicas; `cluster_view` asks both, each on its own event loop (Serve runs routers on
a loop of their own), and returns None until both have registered.

The ingress request router (routing/router/ingress.py) reads back why its pool's
router chose a replica (`take_pick`), to tell that replica.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from autoscaling.placement import ClusterView, DecodeSide, PrefillSide
from kvtransfer.messages import PrefillRequest
from routing.router.policy import RoutingDecision

T = TypeVar("T")


class _PrefillSide(Protocol):
    async def remote_view(self, req: PrefillRequest) -> PrefillSide: ...


class _DecodeSide(Protocol):
    async def local_view(self, req: PrefillRequest) -> DecodeSide | None: ...


_routers: dict[str, tuple[weakref.ref, asyncio.AbstractEventLoop]] = {}


def register(pool: str, router: object) -> None:
    """Called by a router on its own event loop, whenever its replicas change (outside
    a loop, e.g. a unit test feeding a router by hand, there is nothing to register)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    _routers[pool] = (weakref.ref(router), loop)


def _router(pool: str) -> tuple[Any, asyncio.AbstractEventLoop] | None:
    entry = _routers.get(pool)
    if entry is None:
        return None
    router = entry[0]()
    return None if router is None or entry[1].is_closed() else (router, entry[1])


def has_replicas(pool: str) -> bool | None:
    """Whether this process's `pool` router has a replica to send a call to now; None
    when no router of `pool` has registered here. Serve drops a replica from its
    router's set as soon as a call finds its actor dead, and queues calls while the set
    is empty (until a replacement starts: 10-20 s)."""
    entry = _router(pool)
    return None if entry is None else bool(entry[0].curr_replicas)


# A router's loop answers in well under a millisecond; one that does not (stopped with
# its handle) must not hold a request: past this the length rule decides.
_VIEW_TIMEOUT_S = 1.0


async def _on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on `loop` (the router's), from this one, within `_VIEW_TIMEOUT_S`."""
    if loop is asyncio.get_running_loop():
        return await asyncio.wait_for(coro, _VIEW_TIMEOUT_S)
    return await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop)),
                                  _VIEW_TIMEOUT_S)


async def cluster_view(req: PrefillRequest, local: _DecodeSide | None = None) -> ClusterView | None:
    """The prefill pool's least queue and longest prefix of `req`, and the decode
    replica a local prefill would go to: `local` where given (the decode replica this
    process is, which is where the ingress put the request), else the decode router's
    choice; None until the routers it asks have replicas."""
    prefill = _router("prefill")
    decode = _router("decode") if local is None else None
    if prefill is None or (local is None and decode is None):
        return None
    p: _PrefillSide = prefill[0]
    remote = await _on(prefill[1], p.remote_view(req))
    if local is not None:
        seen = await asyncio.wait_for(local.local_view(req), _VIEW_TIMEOUT_S)
    else:
        assert decode is not None
        seen = await _on(decode[1], decode[0].local_view(req))
    if seen is None:
        return None
    return ClusterView(prefill_queued_tokens=remote.queued_tokens, prefill_cached_tokens=remote.cached_tokens,
                       decode_cached_tokens=seen.cached_tokens, decode_running=seen.running, decode_fits=seen.fits)


def take_pick(pool: str, internal_request_id: str) -> RoutingDecision | None:
    """What this process's `pool` router decided for a pick-only choice it made
    (`serve_routers.PICK_ONLY`), once; None if it made none by that id. The ingress
    request router calls it on the router's own loop (Serve runs a replica's routers on
    its loop), right after the choice."""
    found = _router(pool)
    return found[0].take_pick(internal_request_id) if found is not None else None


def event_cursors(pool: str) -> dict[str, int]:
    """Replica → the sequence number up to which this process's `pool` router has
    applied the replica's KV event log (its in-process index; empty with Redis): how
    far behind the replicas' `kv_events_seq` the routers are."""
    found = _router(pool)
    if found is None or getattr(found[0], "index_kind", None) != "memory":
        return {}
    try:
        cursors = dict(found[0]._cursors)  # written on the router's loop: a copy that races a write raises
    except RuntimeError:
        return {}
    return {key: end for key, (_, end) in cursors.items()}


def in_flight(pool: str) -> dict[str, int]:
    """Replica → the calls this process's `pool` router sent there and has not seen
    complete: the load it adds to the replica's own report."""
    found = _router(pool)
    if found is None:
        return {}
    try:
        flights = dict(found[0]._inflight)  # written on the router's loop: a copy that races a write raises
    except RuntimeError:
        return {}
    return {key: len(flight.tokens) for key, flight in flights.items()}
