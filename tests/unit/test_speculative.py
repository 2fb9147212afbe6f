"""N-gram speculative decoding (engine/speculative.py): drafts from the sequence's own
tokens, verified in one forward. Greedy outputs must equal those without it, whatever
else the step does (batching, chunked prefill, stops, limits, preemption, prefix
hits); seeded sampling must be reproducible; the rows that cannot speculate never do."""

import pytest

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative import NgramProposer, accepted_prefix, ngram_draft
from engine.structured import StructuredOutput

pytestmark = pytest.mark.unit

NGRAM = {"method": "ngram", "num_tokens": 4}


def repetitive(engine, n: int, seed: int = 0) -> list[int]:
    """A prompt of a repeating word cycle: its continuation recurs in it, so drafts come."""
    words = "alpha beta gamma delta river mountain table window paper light stone cloud".split()
    text = " ".join(words[(seed * 7 + i * 5) % len(words)] for i in range(n))
    return engine.tokenizer.encode(text)[:n]


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_ngram_draft_takes_the_latest_earlier_continuation_of_the_longest_suffix():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_draft(seq, 1, 3, 2) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert ngram_draft(seq, 1, 3, 10) == [7, 8, 5, 1, 2, 3]  # runs to the end of the sequence
    assert ngram_draft([4, 5, 6, 7], 1, 3, 3) == []  # nothing recurs
    assert ngram_draft([4, 5, 6, 5, 6], 3, 3, 3) == []  # "5 6" recurs, but not three tokens
    assert ngram_draft([4, 5, 6, 5, 6], 2, 3, 3) == [5, 6]
    assert ngram_draft([7], 1, 3, 3) == []


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 1]) == 0


def test_config_rejects_an_inverted_lookup_range():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)


def test_greedy_outputs_equal_no_speculation_in_one_mixed_batch(make_engine, base_engine):
    prompts = [repetitive(base_engine, 20 + 13 * i, seed=i) for i in range(6)]
    prompts.append(chat(base_engine, "Say the word 'hello' ten times."))
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),  # shorter than one draft
              SamplingParams(max_tokens=40, temperature=0, stop=[" cloud"]),  # stop string mid-draft
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0)]
    # A small budget: prefill chunks and drafted decodes share steps.
    want = make_engine(max_num_batched_tokens=64).generate(prompts, params)
    spec = make_engine(max_num_batched_tokens=64, speculative={**NGRAM, "max_batch_size": 8})
    got = spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert spec.num_accepted_tokens > 0 and spec.num_verify_steps > 0
    assert spec.block_pool.num_free_blocks == spec.block_pool.num_blocks


def test_outputs_carry_every_accepted_token_and_their_logprobs(make_engine, base_engine):
    ids = repetitive(base_engine, 60)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    spec = make_engine(speculative=NGRAM)
    outs = list(spec.stream(ids, sp))
    assert any(len(o.new_token_ids) > 1 for o in outs)  # a verified draft arrives as one output
    for o in outs:
        assert [lp.token_id for lp in o.logprobs or []] == o.new_token_ids
    assert outs[-1].metrics is not None and outs[-1].metrics.num_accepted_tokens > 0
    assert sum(len(o.new_token_ids) for o in outs) == 30


def test_seeded_sampling_is_reproducible(make_engine, base_engine):
    ids = repetitive(base_engine, 60)
    sp = SamplingParams(max_tokens=30, temperature=0.7, seed=11, ignore_eos=True)
    first = make_engine(speculative=NGRAM).generate([ids], sp)[0].token_ids
    again = make_engine(speculative=NGRAM).generate([ids], sp)[0].token_ids
    assert first == again and len(first) == 30


def test_rows_whose_sampling_depends_on_the_step_never_speculate(make_engine, base_engine):
    ids = repetitive(base_engine, 60)
    spec = make_engine(speculative=NGRAM)
    penalised = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=0.5)
    structured = SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput("regex", "(alpha |beta )+"))
    spec.generate([ids, ids], [penalised, structured])
    assert spec.num_draft_tokens == 0


def test_above_the_batch_limit_nothing_speculates(make_engine, base_engine):
    prompts = [repetitive(base_engine, 40, seed=i) for i in range(3)]
    spec = make_engine(speculative={**NGRAM, "max_batch_size": 2})
    spec.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert spec.num_draft_tokens == 0


def test_a_request_whose_drafts_fail_stops_drafting():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", min_acceptance=0.5, probe_tokens=8), 2048)
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=8, temperature=0))
    assert proposer.propose(req, 4, 1) == [3, 1, 2]
    req.num_draft_tokens, req.num_accepted_tokens = 7, 0
    assert proposer.propose(req, 4, 1)  # still probing
    req.num_draft_tokens, req.num_accepted_tokens = 8, 4
    assert proposer.propose(req, 4, 1)  # half accepted: enough
    req.num_accepted_tokens = 3
    assert proposer.propose(req, 4, 1) == []  # below the bar after the probe: off
    assert NgramProposer(SpeculativeConfig(method="ngram"), 2048).propose(
        Request("s", [1, 2, 1, 2], SamplingParams(max_tokens=8)), 0, 1) == []  # no room


def test_preemption_and_prefix_hits_keep_outputs_equal(make_engine, base_engine):
    prompts = [repetitive(base_engine, 50, seed=i) for i in range(3)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = make_engine().generate(prompts, sp)
    # 14 blocks of 16 tokens cannot hold three 90-token sequences: someone is preempted.
    spec = make_engine(num_kv_blocks=14, speculative=NGRAM)
    got = spec.generate(prompts, sp)
    assert spec.scheduler.num_preemptions > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    again = spec.generate(prompts[:1], sp)[0]  # the blocks its drafts filled are cached right
    assert again.num_cached_tokens > 0 and again.token_ids == want[0].token_ids
    assert spec.block_pool.num_free_blocks == spec.block_pool.num_blocks
