"""`DrainWatch`: tells a replica the moment Serve stops routing to it.

Serve gives a replica no call when it starts draining it (scale-down, a rolling
update): it stops routing to it, waits for its calls to end, then calls `__del__`. A
decode replica that wants to hand its running sequences on (rather than finish them
here while the pool shrinks) needs to know at the start. It learns it the way Serve's
own routers learn which replicas to route to: by following the controller's list of
the deployment's running replicas (long poll). A replica that was on the list and
is no longer on it, while the deployment has other running replicas, is draining.

Private Serve API (`ray.serve._private.long_poll`), as Serve's routers use it; checked
against Ray 2.60.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)


class DrainState:
    """Whether this replica is draining, from the successive running sets it is shown.
    `others` is the running replicas besides this one when it started draining."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.seen_running = False
        self.draining = False
        self.others: tuple[str, ...] = ()

    def update(self, running: Collection[str]) -> bool:
        """Feed one running set (replica ids); True exactly once: when draining starts
        (this replica left a set it was in, and others remain to take its work)."""
        if self.draining:
            return False
        if self.me in running:
            self.seen_running = True
            return False
        if not self.seen_running or not running:
            return False  # not started yet, or the whole deployment is going away
        self.draining = True
        self.others = tuple(sorted(running))
        return True


class DrainWatch:
    """Follows this Serve replica's deployment; calls `on_drain()` once, on the event
    loop it was started on, when this replica starts draining."""

    def __init__(self, on_drain: Callable[[], None]) -> None:
        self._on_drain = on_drain
        self._client = None
        self.state: DrainState | None = None

    def start(self) -> bool:
        """Start following (idempotent); False outside a Serve replica."""
        if self._client is not None:
            return True
        try:
            import ray
            from ray import serve
            from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
            from ray.serve._private.long_poll import LongPollClient, LongPollNamespace

            ctx = serve.get_replica_context()
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except Exception as e:  # not in a replica (scripts, unit tests)
            log.debug("no drain watch: %s", e)
            return False
        me = ctx.replica_id
        self.state = DrainState(me.unique_id)
        self._client = LongPollClient(
            controller,
            {(LongPollNamespace.DEPLOYMENT_TARGETS, me.deployment_id): self._update},
            call_in_event_loop=asyncio.get_running_loop(),
            client_id=f"duet-drain-watch:{me.unique_id}",
        )
        return True

    def _update(self, targets) -> None:
        assert self.state is not None
        running = [r.replica_id.unique_id for r in targets.running_replicas]
        if self.state.update(running):
            log.warning("replica %s is draining (running now: %s)", self.state.me, ", ".join(self.state.others))
            self._on_drain()

    @property
    def draining(self) -> bool:
        return self.state is not None and self.state.draining

    def stop(self) -> None:
        if self._client is not None:
            self._client.stop()
            self._client = None
