"""Scheduling must never change greedy tokens (fp32): chunking, prefix hits,
preemption and batching each give the same output as one request alone."""

import pytest

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompt_ids(engine, n: int, seed: int = 0) -> list[int]:
    words = "alpha beta gamma delta river mountain table window paper light stone cloud".split()
    text = " ".join(words[(seed * 7 + i * 5) % len(words)] for i in range(n))
    return engine.tokenizer.encode(text)[:n]


def alone(make_engine, ids, sp=GREEDY):
    # 32 blocks hold any one request here (<= 174 tokens); the default 512-block pool
    # would cost ~0.4 GB of KV per reference engine.
    return make_engine(enable_prefix_caching=False, num_kv_blocks=32).generate([ids], sp)[0].token_ids


def test_chunked_prefill_equals_one_shot(make_engine):
    eng = make_engine(enable_prefix_caching=False)
    ids = prompt_ids(eng, 150)
    one_shot = eng.generate([ids], GREEDY)[0].token_ids
    chunked = make_engine(enable_prefix_caching=False, max_num_batched_tokens=32).generate([ids], GREEDY)[0]
    assert chunked.token_ids == one_shot


def test_prefix_cache_hit_equals_miss(make_engine):
    eng = make_engine()
    ids = prompt_ids(eng, 100)
    miss = eng.generate([ids], GREEDY)[0]
    hit = eng.generate([ids], GREEDY)[0]
    assert miss.num_cached_tokens == 0
    assert hit.num_cached_tokens == 96  # six full blocks; the last partial block is computed
    assert hit.token_ids == miss.token_ids
    # A different suffix shares only the common prefix's blocks.
    other = eng.generate([ids[:64] + prompt_ids(eng, 20, seed=3)], GREEDY)[0]
    assert other.num_cached_tokens == 64


def test_preemption_by_recompute_gives_same_tokens(make_engine):
    prompts = [prompt_ids(make_engine(), 40 + 9 * i, seed=i) for i in range(6)]
    want = [alone(make_engine, p) for p in prompts]
    # 6 requests of ~4-6 blocks each into a 20-block pool: the scheduler must preempt.
    eng = make_engine(num_kv_blocks=20, enable_prefix_caching=False)
    got = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in got] == want
    assert eng.block_pool.num_free_blocks == 20


def test_a_prompt_being_computed_is_computed_once(make_engine, base_engine):
    # Arriving together (as the n choices of one request do), the second copy of a
    # prompt waits a step for the first's blocks and hits them; so does a prompt that
    # shares only its first 80 tokens. A prompt under another salt shares nothing.
    ids = prompt_ids(base_engine, 100, seed=7)
    eng = make_engine(max_num_batched_tokens=256)
    outs = eng.generate([ids, ids, ids[:80] + prompt_ids(base_engine, 20, seed=8)], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 96, 80]
    assert outs[0].token_ids == outs[1].token_ids == alone(make_engine, ids)
    assert outs[2].token_ids == alone(make_engine, ids[:80] + prompt_ids(base_engine, 20, seed=8))
    fresh = make_engine(max_num_batched_tokens=256)
    rids = [fresh.add_request(ids, GREEDY, cache_salt=salt) for salt in ("a", "b")]
    fresh.step()
    assert {s.request_id for s in fresh.scheduler.running} == set(rids)  # both computed at once


def test_32_mixed_length_requests_batched_equal_alone(make_engine, base_engine):
    prompts = [prompt_ids(base_engine, 5 + (i * 37) % 120, seed=i) for i in range(32)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [alone(make_engine, p, sp) for p in prompts]
    eng = make_engine(max_num_batched_tokens=256)
    got = eng.generate(prompts, sp)
    assert [r.token_ids for r in got] == want
    assert eng.block_pool.num_free_blocks == eng.block_pool.num_blocks


def test_abort_frees_blocks(engine):
    free0 = engine.block_pool.num_free_blocks
    rid = engine.add_request(prompt_ids(engine, 50), GREEDY)
    engine.step()
    assert engine.block_pool.num_free_blocks < free0
    assert engine.abort(rid)
    outs = engine.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert engine.block_pool.num_free_blocks == free0


def test_logit_bias_changes_its_own_row_only(make_engine, base_engine):
    ids = prompt_ids(base_engine, 40, seed=5)
    other = prompt_ids(base_engine, 30, seed=6)
    want = alone(make_engine, ids)
    banned = SamplingParams(max_tokens=len(want), temperature=0, ignore_eos=True, logit_bias={want[0]: -100.0})
    got = make_engine().generate([ids, other], [banned, GREEDY])
    assert got[0].token_ids[0] != want[0]
    assert got[1].token_ids == alone(make_engine, other)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        make_engine().add_request(ids, SamplingParams(logit_bias={base_engine.model_config.vocab_size: 1.0}))
