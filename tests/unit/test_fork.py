"""Forked choices (`n` > 1, `Request.fork_of`): a choice of a running request shares
that request's prompt KV (full blocks with one more reference, the block holding the
last prompt token copied) and computes only its last prompt token again, for its own
first token. Its output equals what it produces computed alone; every block is freed
exactly once; a choice whose parent is gone, or differs, is computed as any request."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

# 37 tokens: two full blocks of 16 and 5 in the third.
PROMPT = list(range(100, 137))


def _run(eng, requests: dict[str, tuple[SamplingParams, str | None]], prompt=PROMPT, salts=None):
    """Add each request (id → (sampling, fork_of)) and step to the end; id → tokens."""
    for rid, (sp, fork_of) in requests.items():
        eng.add_request(prompt, sp, request_id=rid, fork_of=fork_of, cache_salt=(salts or {}).get(rid))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(200):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not eng.has_unfinished()
    return tokens


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)


def test_forks_equal_their_choices_computed_alone(make_engine):
    alone = {}
    for i in range(3):
        alone.update(_run(make_engine(), {f"c{i}": (_sampled(7 + i), None)}))
    eng = make_engine()
    forked = _run(eng, {"c0": (_sampled(7), None), "c1": (_sampled(8), "c0"), "c2": (_sampled(9), "c0")})
    assert forked == alone
    assert eng.scheduler.num_forks == 2 and eng.stats().num_forks == 2
    assert eng.block_pool.num_free_blocks == eng.block_pool.num_blocks  # every reference dropped once


def test_greedy_forks_repeat_the_parent(make_engine):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng = make_engine()
    got = _run(eng, {"c0": (greedy, None), "c1": (greedy, "c0")})
    assert got["c0"] == got["c1"] and len(got["c0"]) == 6
    assert eng.scheduler.num_forks == 1


def test_a_fork_shares_full_blocks_and_copies_the_last(make_engine):
    eng = make_engine()
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request(PROMPT, sp, request_id="c0")
    eng.step()  # c0's prompt, and its first token
    parent = eng.scheduler.requests["c0"]
    eng.add_request(PROMPT, sp, request_id="c1", fork_of="c0")
    sched = eng.scheduler.schedule()
    child = eng.scheduler.requests["c1"]
    assert child.block_ids[:2] == parent.block_ids[:2]  # the two full blocks, shared
    assert [eng.block_pool.blocks[b].ref_cnt for b in child.block_ids[:2]] == [2, 2]
    assert child.block_ids[2] != parent.block_ids[2]
    assert sched.block_copies == [(parent.block_ids[2], child.block_ids[2])]
    assert child.num_computed_tokens == len(PROMPT) - 1
    assert [s.num_new_tokens for s in sched.scheduled if s.request is child] == [1]
    eng.abort("c0")
    eng.abort("c1")
    assert eng.block_pool.num_free_blocks == eng.block_pool.num_blocks


def test_a_fork_waits_while_its_parent_computes_the_prompt(make_engine):
    eng = make_engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.add_request(PROMPT, sp, request_id="c0")
    eng.add_request(PROMPT, sp, request_id="c1", fork_of="c0")
    eng.step()  # c0's first chunk; c1 waits instead of computing the prompt beside it
    assert eng.scheduler.requests["c1"].num_cached_tokens == -1  # never scheduled
    assert eng.scheduler.requests["c0"].num_computed_tokens == 16
    _run(eng, {})
    assert eng.scheduler.num_forks == 1
    assert eng.block_pool.num_free_blocks == eng.block_pool.num_blocks


@pytest.mark.parametrize("case", ["parent gone", "other prompt", "other salt"])
def test_a_choice_without_its_parent_is_computed(make_engine, case):
    eng = make_engine()
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = _run(make_engine(), {"alone": (sp, None)})["alone"]
    if case == "parent gone":
        _run(eng, {"c0": (sp, None)})
        got = _run(eng, {"c1": (sp, "c0")})["c1"]
    elif case == "other prompt":
        eng.add_request(PROMPT[:-1] + [5], sp, request_id="c0")
        got = _run(eng, {"c1": (sp, "c0")})["c1"]
    else:
        got = _run(eng, {"c0": (sp, None), "c1": (sp, "c0")}, salts={"c1": "tenant-b"})["c1"]
    assert got == want
    assert eng.scheduler.num_forks == 0
    assert eng.block_pool.num_free_blocks == eng.block_pool.num_blocks


def test_one_token_prompt_and_block_aligned_prompt_fork(make_engine):
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    for prompt in ([42], PROMPT[:32]):
        want = _run(make_engine(), {"alone": (sp, None)}, prompt=prompt)["alone"]
        eng = make_engine()
        got = _run(eng, {"c0": (SamplingParams(max_tokens=5, ignore_eos=True), None), "c1": (sp, "c0")}, prompt=prompt)
        assert got["c1"] == want and eng.scheduler.num_forks == 1
        assert eng.block_pool.num_free_blocks == eng.block_pool.num_blocks


def test_a_fork_aborted_before_it_runs_frees_nothing_twice(make_engine):
    eng = make_engine()
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request(PROMPT, sp, request_id="c0")
    eng.step()
    eng.add_request(PROMPT, sp, request_id="c1", fork_of="c0")
    eng.scheduler.schedule()  # forked: shares c0's blocks
    assert eng.abort("c1")
    _run(eng, {})
    assert eng.scheduler.requests == {} and eng.block_pool.num_free_blocks == eng.block_pool.num_blocks
