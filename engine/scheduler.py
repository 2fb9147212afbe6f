"""Continuous batching with a per-step token budget.

Each step: running requests that need one token (decodes) are scheduled first,
then running requests still in prefill get a chunk, then waiting requests are
admitted in (priority, arrival) order while the budget, `max_num_seqs` and the
block pool allow. A waiting request whose prompt's leading blocks a running request
is computing right now waits for them to be cached instead of computing them too.
A request that is another choice of a running one (`n` > 1, `Request.fork_of`) forks
that one's prompt KV once it is computed: the full blocks shared, the last one copied
(`SchedulerOutput.block_copies`, made by the engine before the forward).
When blocks run out, the lowest-priority running request not yet scheduled this
step is preempted by recompute: its blocks are freed and it goes back to the head
of the queue with its generated tokens kept.

With speculative decoding, a decode may carry draft tokens (engine/speculative.py):
it then runs as a chunk of its pending token plus the drafts, when the budget and
the pool have room for them, and as a plain decode otherwise.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager, PrefixMatch
from engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # rows in the step, draft tokens included
    # Speculative decoding: tokens guessed to follow the sequence, scored in this step
    # after its pending token; `commit` advances past the pending token only.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_sequence_tokens(self) -> int:
        """Rows that are already the sequence's tokens (not drafts)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        c = self.request.num_computed_tokens
        return self.request.token_ids[c : c + self.num_sequence_tokens] + self.draft_token_ids

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_sequence_tokens == self.request.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits a chunk that `samples` samples: its last sequence row, and
        one per draft token."""
        return 1 + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledRequest] = field(default_factory=list)  # one new token each
    prefills: list[ScheduledRequest] = field(default_factory=list)  # chunks of > 1 token (drafts too)
    preempted: list[str] = field(default_factory=list)
    # (source, destination) blocks whose KV is copied before the forward: forks' own
    # copies of the block holding their prompt's last token.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.decodes + self.prefills

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """Owns the waiting queue and the running set; decides each step's batch."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 propose: Callable[[list[Request], int, int], dict[str, list[int]]] | None = None):
        """`propose(decoding, most_tokens, num_decoding)`: draft tokens for the decodes
        of a step by request id, all at once (speculative decoding; a draft model runs
        them as one batch), or None for none ever."""
        self.kv = kv
        self.propose = propose
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_forks = 0  # requests admitted with a sibling's prompt KV (`fork_of`)
        # Off only to measure what waiting for a shared prefix saves (`duet bench choices`).
        self.wait_for_shared_prefix = True

    # ------------------------------------------------------------ admission
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.status is RequestStatus.RUNNING:  # imported KV: joins the batch directly
            self.running.append(req)
            return
        self._enqueue(req)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        req.status = RequestStatus.WAITING
        if front:
            self.waiting.appendleft(req)
        elif not self.waiting or self.waiting[-1].sort_key <= req.sort_key:
            self.waiting.append(req)
        else:  # priority insert; FCFS queues take the fast path above
            items = sorted([*self.waiting, req], key=lambda r: r.sort_key)
            self.waiting = deque(items)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    # ------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        scheduled: set[str] = set()

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        drafts = self.propose(decoding, budget - 1, len(decoding)) if self.propose and budget >= 2 else {}
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._draft(req, drafts.get(req.request_id), budget) if n == 1 else []
            if draft:
                n += len(draft)
            elif not self._allocate_or_preempt(req, n, scheduled, out):
                continue
            (out.decodes if n == 1 else out.prefills).append(ScheduledRequest(req, n, draft))
            scheduled.add(req.request_id)
            budget -= n
            if req.first_scheduled_time is None:  # imported KV: its first step
                req.first_scheduled_time = time.monotonic()

        deferred: list[Request] = []  # their prompt's blocks are being computed by another
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            parent = self._sibling(req)
            # A sibling here that has not computed the prompt yet is waited for, as a shared prefix is.
            if (parent is not None and not _prompt_computed(parent, req)) or self._prefix_being_computed(req):
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.max_num_seqs:  # a burst on one prefix: look no further
                    break
                continue
            if parent is not None:
                forked = self._admit_fork(req, parent, budget, out)
                if forked is None:
                    break
                n, pool_tokens = forked, req.num_computed_tokens
            else:
                match = self.kv.match_prefix(req) if req.num_computed_tokens == 0 else PrefixMatch([])
                ready = len(match.blocks) * self.kv.block_size + match.num_external_tokens
                n = min(req.num_tokens - max(ready, req.num_computed_tokens), budget)
                if not self.kv.allocate_slots(req, n + match.num_external_tokens, match.blocks):
                    break
                if match.num_external_tokens:
                    self.kv.load_external(req, match)
                pool_tokens = min(len(match.blocks) * self.kv.block_size, req.num_computed_tokens)
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                req.first_scheduled_time = time.monotonic()
                if pool_tokens:
                    req.cached_tokens_by_source["pool"] = pool_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            (out.decodes if n == 1 else out.prefills).append(ScheduledRequest(req, n))
            scheduled.add(req.request_id)
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back in their places, ahead of the rest
        return out

    def _sibling(self, req: Request) -> Request | None:
        """The choice whose prompt KV `req` forks (`fork_of`), if it is here with the same
        prompt and salt; None: `req` is computed as any request is (that choice
        finished, failed, or ran elsewhere)."""
        if req.fork_of is None or req.num_computed_tokens:
            return None
        parent = self.requests.get(req.fork_of)
        if (parent is None or parent.is_finished or parent.cache_salt != req.cache_salt
                or parent.prompt_token_ids != req.prompt_token_ids):
            return None
        return parent

    def _admit_fork(self, req: Request, parent: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Fork `parent`'s prompt KV into `req` and allocate the rest of its chunk; the
        chunk's tokens, or None (and no change) when the pool cannot."""
        copy = self.kv.fork(req, parent)
        if copy is None:
            return None
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.kv.allocate_slots(req, n):  # only a preempted choice has more than its last token to compute
            self.kv.free(req)
            req.num_computed_tokens = 0
            return None
        out.block_copies.append(copy)
        self.num_forks += 1
        return n

    def _prefix_being_computed(self, req: Request) -> bool:
        """Whether a running request is computing leading blocks of `req`'s prompt that
        are not cached yet. Then `req` waits: a block is cached as soon as it is
        computed, so a step or a few later `req` hits it instead of computing the same
        tokens beside it (the `n` choices of one request, or a burst of requests with
        one system prompt, arrive together). It cannot wait forever: the request it
        waits on is running, and running prefills get the budget before anything waiting."""
        if req.num_computed_tokens or not self.wait_for_shared_prefix or not self.kv.pool.enable_caching:
            return False
        computing = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        if not computing:
            return False
        hashes = self.kv.hittable_hashes(req)
        shared = max(_common_prefix_len(hashes, r.block_hashes) for r in computing)
        return shared > len(self.kv.pool.cached_prefix(hashes[:shared]))

    def _draft(self, req: Request, draft: list[int] | None, budget: int) -> list[int]:
        """`draft` cut to the step's room, its slots allocated, or [] (then the caller
        schedules a plain decode). Never preempts: a draft is optional."""
        if not draft or budget < 2:
            return []
        draft = draft[: budget - 1]  # a draft's leading tokens are a draft too
        if not self.kv.allocate_slots(req, 1 + len(draft)):
            return []
        return draft

    def _allocate_or_preempt(self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, n):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=lambda r: r.sort_key)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    # ------------------------------------------------------------ after the forward
    def commit(self, out: SchedulerOutput) -> None:
        """Advance progress for everything that ran, and cache newly full blocks."""
        for s in out.scheduled:
            req = s.request
            before = req.num_computed_tokens
            req.num_computed_tokens += s.num_sequence_tokens
            self.kv.cache_computed_blocks(req)
            if before < req.num_prompt_tokens <= req.num_computed_tokens:
                self.kv.store_external(req)

    def finish(self, req: Request, reason: FinishReason, keep_blocks: bool = False) -> list[int]:
        """Remove a request; returns its blocks when `keep_blocks` (prefill export)."""
        if req.is_finished:
            return []
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        if keep_blocks:
            return self.kv.detach(req)
        self.kv.free(req)
        return []


def _prompt_computed(parent: Request, child: Request) -> bool:
    """Whether `parent` runs with the prompt it shares with `child` computed up to its
    last token (the one a fork computes again)."""
    return parent.status is RequestStatus.RUNNING and parent.num_computed_tokens >= child.num_prompt_tokens - 1


def _common_prefix_len(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
