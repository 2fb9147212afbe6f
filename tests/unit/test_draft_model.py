"""Draft-model speculative decoding (engine/draft_model.py): a second checkpoint of the
target's vocabulary drafts greedily, the target verifies. Outputs never depend on the
draft: with the target's own weights as the draft every draft is accepted, with a
random-weight draft almost none is, and greedy outputs equal no speculation either
way, through mixed batches, stops, a tight draft KV pool, a moved sequence and an
imported one. The draft's pages all come back when the requests end."""

from dataclasses import replace

import pytest
from engine_steps import run

from bench.random_checkpoint import SHAPES, write_checkpoint, write_tokenizer
from engine.config import ConfigError, SpeculativeConfig
from engine.draft_model import DraftModelProposer
from engine.request import Request
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

SELF_DRAFT = {"method": "draft", "draft_model": "smollm2-135m", "num_tokens": 4}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """A tiny random-weight checkpoint with SmolLM2's vocabulary size: a draft the
    target rejects almost always."""
    directory = tmp_path_factory.mktemp("random-draft")
    shape = replace(SHAPES["tiny"], vocab_size=49152, max_position_embeddings=2048, rope_scaling=None)
    write_checkpoint(directory, shape)
    write_tokenizer(directory, shape.vocab_size)
    return str(directory)


def test_config_requires_a_draft_model_for_method_draft_and_only_there():
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="ngram", draft_model="smollm2-135m")


def test_the_targets_own_weights_as_draft_accept_every_draft(make_engine, base_engine):
    prompts = [chat(base_engine, t) for t in ("Tell me about the sea.", "Name three colours.")]
    params = [GREEDY, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),  # shorter than one draft
              SamplingParams(max_tokens=30, temperature=0, stop=[" the"])]  # a stop string inside a draft
    prompts.append(prompts[0])
    want = make_engine().generate(prompts, params)
    spec = make_engine(speculative=SELF_DRAFT)
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.proposer.model is spec.model  # the same checkpoint: its weights, not a second copy
    assert spec.proposer.num_free_blocks == spec.proposer.kv_cache.num_blocks


def test_requests_that_draft_together_share_the_draft_models_forwards(make_engine, base_engine):
    prompts = [chat(base_engine, t) for t in ("Name a river.", "Name a mountain.", "Name a city.")]
    want = make_engine().generate(prompts, GREEDY)
    spec = make_engine(speculative=SELF_DRAFT)
    got = spec.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    # Three requests draft in the same steps, four tokens each: four forwards a step,
    # where one request at a time would take twelve.
    assert spec.num_verify_steps > 2 * spec.num_steps  # most steps verified all three
    assert spec.proposer.num_forwards <= SELF_DRAFT["num_tokens"] * spec.num_steps


def test_a_random_draft_changes_no_output_and_is_turned_off(make_engine, base_engine, random_draft):
    prompts = [chat(base_engine, "Write a sentence about rivers."), chat(base_engine, "Count to five.")]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = make_engine().generate(prompts, sp)
    spec = make_engine(speculative={**SELF_DRAFT, "draft_model": random_draft, "probe_tokens": 8})
    got = spec.generate(prompts, sp)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.proposer.model is not spec.model
    assert 0 < spec.num_draft_tokens <= 2 * (8 + 4)  # each request stops drafting after its probe
    assert spec.num_accepted_tokens < spec.num_draft_tokens


def test_seeded_sampling_with_a_draft_is_reproducible(make_engine, base_engine):
    prompt = chat(base_engine, "Describe a forest.")
    sp = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    first = make_engine(speculative=SELF_DRAFT).generate([prompt], sp)[0]
    second = make_engine(speculative=SELF_DRAFT).generate([prompt], sp)[0]
    assert first.token_ids == second.token_ids


def test_a_draft_pool_smaller_than_the_batch_drafts_for_fewer_and_still_matches(make_engine, base_engine):
    prompts = [chat(base_engine, f"Say something about the number {i}.") for i in range(3)]
    want = make_engine().generate(prompts, GREEDY)
    # 64 draft tokens hold one of these ~60-token sequences at most: the others draft
    # nothing while it holds the pages.
    spec = make_engine(speculative={**SELF_DRAFT, "draft_kv_tokens": 64})
    got = spec.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert 0 < spec.num_verify_steps < spec.num_steps * len(prompts)
    assert spec.proposer.num_free_blocks == spec.proposer.kv_cache.num_blocks


def test_the_least_recently_drafting_request_gives_its_pages_up(base_engine):
    cfg = SpeculativeConfig(**{**SELF_DRAFT, "draft_kv_tokens": 64})  # 4 pages of 16 tokens
    proposer = DraftModelProposer(cfg, 2048, base_engine.model, 16)
    a = Request("a", list(range(100, 140)), SamplingParams(max_tokens=20, temperature=0))
    b = Request("b", list(range(200, 240)), SamplingParams(max_tokens=20, temperature=0))
    assert len(proposer.propose(a, 4, 1)) == 4  # 40 tokens and 3 drafts' KV: 3 pages
    assert proposer.num_free_blocks == 1
    assert len(proposer.propose(b, 4, 1)) == 4  # a drafted less recently: its pages go to b
    assert proposer.num_evictions == 1
    # Drafting together, neither takes the other's pages: a, which needs three, drafts nothing.
    assert proposer.propose_all([a, b], 4, 2).keys() == {"b"}
    assert proposer.num_evictions == 1
    proposer.forget("b")
    assert proposer.num_free_blocks == 4


def test_an_imported_request_is_drafted_from_its_prompt(make_engine, base_engine):
    """A decode engine has no draft KV for a prompt whose KV came from elsewhere: the
    draft model prefills it on its first draft."""
    prompt = chat(base_engine, "What is the capital of Italy?")
    want = make_engine().generate([prompt], GREEDY)[0]
    src, dst = make_engine(), make_engine(speculative=SELF_DRAFT)
    src.add_request(prompt, GREEDY, request_id="r")
    before = run(src, "r", n_steps=2)
    seq = src.move_out("r")
    assert seq is not None
    blocks = dst.reserve_import(seq.num_computed_tokens)
    assert blocks is not None
    dst.kv_cache.data[blocks] = src.kv_cache.data[seq.block_ids]
    src.release_blocks(seq.block_ids)
    dst.add_imported_request("r", seq.token_ids[:-1], seq.token_ids[-1], GREEDY, blocks, resume=seq.resume)
    after = run(dst, "r")
    assert [t for o in before + after for t in o.new_token_ids] == want.token_ids
    assert dst.num_accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(make_engine, tmp_path):
    shape = replace(SHAPES["tiny"], max_position_embeddings=2048, rope_scaling=None)  # 384 tokens
    write_checkpoint(tmp_path, shape)
    write_tokenizer(tmp_path, shape.vocab_size)
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        make_engine(speculative={**SELF_DRAFT, "draft_model": str(tmp_path)})


def test_a_draft_model_that_does_not_exist_is_refused_by_its_setting(make_engine, tmp_path):
    with pytest.raises(ConfigError, match="^speculative.draft_model: ") as e:
        make_engine(speculative={**SELF_DRAFT, "draft_model": str(tmp_path / "nowhere")})
    assert e.value.field == "speculative.draft_model"


def test_a_prefill_engine_never_drafts(make_engine):
    assert make_engine(role="prefill", speculative=SELF_DRAFT).proposer is None
