"""Runs one sweep point: warm-up, then sessions under an arrival process.

Owns scheduling only: when each session starts (open loop, closed loop or trace)
and how a multi-turn session's history grows with the server's actual answers.
HTTP is the client's job; numbers are the metrics module's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tqdm import tqdm

from loadgen.arrivals import ArrivalProcess
from loadgen.client import OpenAIClient
from loadgen.records import RequestResult, Session
from loadgen.tokenizer import TokenizerLike, count_tokens
from loadgen.workloads import num_requests


@dataclass
class PointRun:
    """The raw outcome of one sweep point; warm-up results are kept but flagged."""

    arrival: ArrivalProcess
    results: list[RequestResult]
    duration_s: float
    started_at: float  # epoch seconds, for the report
    t0: float = 0.0  # perf_counter() at the point's start; request send times are relative to it


def render(session: Session, k: int, answers: list[str], chat: bool) -> str | list[dict[str, str]]:
    """The prompt of turn k: system prompt, earlier turns with the server's answers,
    then this turn's user text."""
    turns = session.turns
    if chat:
        msgs = [{"role": "system", "content": session.system_prompt}] if session.system_prompt else []
        for t, a in zip(turns[:k], answers):
            msgs += [{"role": "user", "content": t.prompt}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": turns[k].prompt}]
    parts = [session.system_prompt] if session.system_prompt else []
    for t, a in zip(turns[:k], answers):
        parts += [t.prompt, a]
    return "\n\n".join(parts + [turns[k].prompt])


async def run_session(
    client: OpenAIClient,
    session: Session,
    tokenizer: TokenizerLike,
    ignore_eos: bool,
    out: list[RequestResult],
    pbar: tqdm | None = None,
    warmup: bool = False,
) -> None:
    answers: list[str] = []
    history_tokens = session.system_prompt_tokens
    for k, turn in enumerate(session.turns):
        if k and turn.think_time_s > 0:
            await asyncio.sleep(turn.think_time_s)
        prompt = render(session, k, answers, client.endpoint == "chat")
        res = RequestResult(
            session_id=session.session_id,
            turn_index=k,
            prompt_tokens=history_tokens + turn.prompt_tokens,
            max_tokens=turn.output_tokens,
            ignore_eos=ignore_eos,
            warmup=warmup,
        )
        await client.send(prompt, res)
        out.append(res)
        if pbar is not None:
            pbar.update(1)
        # A failed turn leaves an empty answer; later turns are still sent so the
        # number of submitted requests does not depend on the server's failures.
        answers.append(res.text)
        history_tokens += turn.prompt_tokens + count_tokens(tokenizer, res.text)


async def run_point(
    client: OpenAIClient,
    sessions: list[Session],
    arrival: ArrivalProcess,
    tokenizer: TokenizerLike,
    ignore_eos: bool = False,
    warmup: int = 0,
    progress: bool = True,
    warmup_sessions: list[Session] | None = None,
) -> PointRun:
    """Warm up with `warmup` sequential single requests, then run all sessions.

    Warm-up prompts come from `warmup_sessions` when given; with the measured
    sessions themselves, a prefix cache would serve the measured prompts."""
    results: list[RequestResult] = []
    pool = warmup_sessions or sessions
    for i in range(warmup):
        s = pool[i % len(pool)]
        await run_session(client, Session(s.session_id, s.turns[:1], s.system_prompt, s.system_prompt_tokens),
                          tokenizer, ignore_eos, results, warmup=True)

    pbar = tqdm(total=num_requests(sessions), desc=arrival.label, unit="req", disable=not progress, leave=False)
    started_at = time.time()
    t0 = time.perf_counter()

    async def at(delay: float, s: Session) -> None:
        await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
        await run_session(client, s, tokenizer, ignore_eos, results, pbar)

    if arrival.trace:
        await asyncio.gather(*(at(s.arrival_s or 0.0, s) for s in sessions))
    elif arrival.closed_loop:
        queue = list(reversed(sessions))

        async def worker() -> None:
            while queue:
                await run_session(client, queue.pop(), tokenizer, ignore_eos, results, pbar)

        await asyncio.gather(*(worker() for _ in range(min(arrival.concurrency, len(sessions)))))
    else:
        starts = arrival.start_times(len(sessions))
        await asyncio.gather(*(at(float(t), s) for t, s in zip(starts, sessions)))
    duration = time.perf_counter() - t0
    pbar.close()
    return PointRun(arrival, results, duration, started_at, t0)
