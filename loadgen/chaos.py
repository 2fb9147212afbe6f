"""A chaos soak: many requests against a live OpenAI-compatible server while faults are
injected, with every request accounted for.

The client side of the reliability soak: a closed loop of `concurrency` clients sends
`num_requests` chat requests, mixed streaming and not, greedy and sampled; a fraction
of the clients disconnect at a random point (mid-stream, or before a non-streamed
answer). Faults are the caller's (kill a replica, restart Redis: this module knows
nothing of Ray) and fire when a given number of requests have finished, so a run is
the same sequence of events however fast the machine is. Greedy requests are checked
against a reference pass taken before any fault; every request ends within its
deadline or is reported as hung.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# Distinct conversations: a few shared system prompts (prefix cache and KV tier hits)
# times a few questions.
_SYSTEMS = (
    "You are a helpful assistant who answers briefly.",
    "You are a lighthouse keeper on a small island. Stay in character and speak plainly about the sea.",
    "You are a careful maths tutor. Explain each step so that a twelve year old can follow it.",
    "You are a travel guide for old harbour towns, fond of bridges, markets, ships and local history.",
)
_QUESTIONS = (
    "What is the capital of France?",
    "Tell me a short story about a fox.",
    "Why is the sky blue?",
    "Name three colours of autumn leaves.",
    "How do bees make honey?",
    "What should I pack for a rainy day?",
    "Count from one to ten in words.",
    "Describe a quiet morning in a few sentences.",
)


@dataclass(frozen=True)
class SoakPlan:
    num_requests: int = 1000
    concurrency: int = 16
    disconnect_fraction: float = 0.1
    stream_fraction: float = 0.5
    greedy_fraction: float = 0.8
    max_tokens: tuple[int, int] = (4, 24)
    # Client-side bound on one request; above the gateway's own request deadline.
    deadline_s: float = 120.0
    seed: int = 0


@dataclass(frozen=True)
class Fault:
    """`action` (blocking; run in a thread) fires once `after` requests have finished."""

    name: str
    after: int
    action: Callable[[], Any]


@dataclass(frozen=True)
class Case:
    """One conversation; greedy answers to it are compared with the reference pass."""

    index: int
    messages: tuple[tuple[str, str], ...]
    max_tokens: int

    def body(self, stream: bool, temperature: float, seed: int | None) -> dict[str, Any]:
        b: dict[str, Any] = {  # no "model": the server's one
            "messages": [{"role": r, "content": c} for r, c in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": temperature,
            "ignore_eos": True,  # every answer is exactly max_tokens long
            "stream": stream,
        }
        if seed is not None:
            b["seed"] = seed
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b


@dataclass
class Result:
    index: int
    case: int
    stream: bool
    greedy: bool
    disconnect_after: float | None  # chunks (stream) or seconds (not); None: stays
    seed: int | None = None  # sampled requests only
    outcome: str = "pending"  # completed | disconnected | failed | hung
    status: int | None = None
    error: str | None = None
    text: str = ""
    completion_tokens: int | None = None
    started_s: float = 0.0  # since the run began
    seconds: float = 0.0
    matches_reference: bool | None = None
    response_id: str | None = None


@dataclass
class FaultRecord:
    name: str
    after: int
    started_s: float
    seconds: float
    error: str | None = None


@dataclass
class SoakReport:
    plan: dict
    seconds: float
    outcomes: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    faults: list[FaultRecord]
    failures: list[dict]
    # Clients drawn to hang up; a non-streamed one whose answer came first completed.
    disconnects_planned: int
    greedy_checked: int
    greedy_mismatches: int
    wrong_lengths: int
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def cases(seed: int, max_tokens: tuple[int, int]) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for s in _SYSTEMS:
        for q in _QUESTIONS:
            out.append(Case(len(out), (("system", s), ("user", q)), rng.randint(*max_tokens)))
    return out


class ChaosSoak:
    """Run `plan` against `base_url` (the server root, no `/v1`) with `faults`."""

    def __init__(self, base_url: str, plan: SoakPlan, faults: list[Fault] = (), api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.plan, self.faults = plan, sorted(faults, key=lambda f: f.after)
        self.cases = cases(plan.seed, plan.max_tokens)
        self.reference: dict[int, str] = {}
        self.results: list[Result] = []  # of the last run, for a caller to look into
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                       timeout=httpx.Timeout(plan.deadline_s),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                       transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def take_reference(self) -> None:
        """Each case once, greedy, before any fault: the expected texts. Sent together:
        greedy output does not depend on what else shares the batch (the engine's
        batched-equals-alone tests), and the soak itself relies on that."""
        refs = [Result(-1, case.index, stream=False, greedy=True, disconnect_after=None) for case in self.cases]
        await asyncio.gather(*(self._send(case, r, seed=None) for case, r in zip(self.cases, refs, strict=True)))
        for r in refs:
            if r.outcome != "completed":
                raise RuntimeError(f"reference request for case {r.case} failed: {r.status} {r.error}")
            self.reference[r.case] = r.text

    async def run(self) -> SoakReport:
        if not self.reference:
            await self.take_reference()
        plan = self.plan
        rng = random.Random(plan.seed + 1)
        results = self.results = [self._draw(i, rng) for i in range(plan.num_requests)]
        queue: asyncio.Queue[Result] = asyncio.Queue()
        for r in results:
            queue.put_nowait(r)
        finished = 0
        pending_faults = list(self.faults)
        fault_tasks: list[asyncio.Task] = []
        records: list[FaultRecord] = []
        start = time.monotonic()

        def fire_due() -> None:
            while pending_faults and finished >= pending_faults[0].after:
                fault_tasks.append(asyncio.create_task(self._fire(pending_faults.pop(0), start, records)))

        async def client() -> None:
            nonlocal finished
            while not queue.empty():
                r = queue.get_nowait()
                await self._send(self.cases[r.case], r, r.seed, start)
                finished += 1
                fire_due()

        await asyncio.gather(*(client() for _ in range(plan.concurrency)))
        await asyncio.gather(*fault_tasks)
        return self._report(results, records, time.monotonic() - start)

    def _draw(self, index: int, rng: random.Random) -> Result:
        case = rng.randrange(len(self.cases))
        stream = rng.random() < self.plan.stream_fraction
        disconnect = None
        if rng.random() < self.plan.disconnect_fraction:
            n = self.cases[case].max_tokens
            disconnect = float(rng.randrange(n)) if stream else rng.uniform(0.0, 2.0)
        greedy = rng.random() < self.plan.greedy_fraction
        return Result(index, case, stream, greedy, disconnect, seed=None if greedy else rng.randrange(2**31))

    async def _fire(self, fault: Fault, start: float, records: list[FaultRecord]) -> None:
        t0 = time.monotonic()
        rec = FaultRecord(fault.name, fault.after, round(t0 - start, 2), 0.0)
        try:
            await asyncio.to_thread(fault.action)
        except Exception as e:  # reported; the soak goes on
            rec.error = f"{type(e).__name__}: {e}"
        rec.seconds = round(time.monotonic() - t0, 2)
        records.append(rec)

    async def _send(self, case: Case, r: Result, seed: int | None, start: float | None = None) -> None:
        body = case.body(r.stream, 0.0 if r.greedy else 0.8, seed)
        t0 = time.monotonic()
        r.started_s = round(t0 - (start or t0), 3)
        try:
            if r.stream:
                work = self._stream(body, r)
            else:
                work = self._post(body, r)
            limit = self.plan.deadline_s
            if not r.stream and r.disconnect_after is not None:
                limit = min(limit, r.disconnect_after)
            await asyncio.wait_for(work, limit)
        except _Disconnect:
            r.outcome = "disconnected"
        except TimeoutError:
            if not r.stream and r.disconnect_after is not None and time.monotonic() - t0 < self.plan.deadline_s:
                r.outcome = "disconnected"  # we hung up before the answer came
            else:
                r.outcome, r.error = "hung", f"no answer within {self.plan.deadline_s:g}s"
        except httpx.HTTPError as e:
            r.outcome, r.error = "failed", f"{type(e).__name__}: {e}"
        r.seconds = round(time.monotonic() - t0, 3)
        if r.outcome == "completed" and r.greedy and case.index in self.reference:
            r.matches_reference = r.text == self.reference[case.index]

    async def _post(self, body: dict, r: Result) -> None:
        resp = await self._http.post("/v1/chat/completions", json=body)
        r.status = resp.status_code
        if resp.status_code != 200:
            r.outcome, r.error = "failed", resp.text[:500]
            return
        data = resp.json()
        r.response_id = data.get("id")
        r.text = data["choices"][0]["message"]["content"] or ""
        r.completion_tokens = data["usage"]["completion_tokens"]
        r.outcome = "completed"

    async def _stream(self, body: dict, r: Result) -> None:
        chunks = 0
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.outcome, r.error = "failed", (await resp.aread()).decode(errors="replace")[:500]
                return
            async for line in resp.aiter_lines():
                if r.disconnect_after is not None and chunks >= r.disconnect_after:
                    raise _Disconnect  # leaving the block closes the connection mid-stream
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    r.outcome, r.error = "failed", json.dumps(event["error"])[:500]
                    return
                r.response_id = r.response_id or event.get("id")
                if event.get("usage"):
                    r.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        r.text += text
                        chunks += 1
        r.outcome = "completed" if r.completion_tokens is not None else "failed"
        if r.outcome == "failed":
            r.error = "stream ended without usage"

    def _report(self, results: list[Result], faults: list[FaultRecord], seconds: float) -> SoakReport:
        outcomes = Counter(r.outcome for r in results)
        by_kind: dict[str, Counter] = {}
        for r in results:
            kind = ("stream" if r.stream else "plain") + ("/greedy" if r.greedy else "/sampled")
            by_kind.setdefault(kind, Counter())[r.outcome] += 1
        completed = [r for r in results if r.outcome == "completed"]
        checked = [r for r in completed if r.matches_reference is not None]
        wrong_length = [r for r in completed if r.completion_tokens != self.cases[r.case].max_tokens]
        failures = [{k: v for k, v in asdict(r).items() if k != "text"} for r in results
                    if r.outcome in ("failed", "hung") or r.matches_reference is False or r in wrong_length]
        return SoakReport(
            plan=asdict(self.plan), seconds=round(seconds, 1), outcomes=dict(outcomes),
            by_kind={k: dict(v) for k, v in sorted(by_kind.items())}, faults=sorted(faults, key=lambda f: f.after),
            failures=failures[:50], disconnects_planned=sum(r.disconnect_after is not None for r in results),
            greedy_checked=len(checked),
            greedy_mismatches=sum(not r.matches_reference for r in checked), wrong_lengths=len(wrong_length),
        )


class _Disconnect(Exception):
    """The client hangs up on purpose."""
