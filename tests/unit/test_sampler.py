"""Sampler: seeding, top-k/top-p masks, penalties, logprobs."""

import math

import pytest
import torch

from engine.errors import InvalidRequest
from engine.request import Request
from engine.sampler import Sampler, apply_penalties, top_k_top_p_mask
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def req(**kw) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(**kw))
    if r.sampling.seed is not None:
        r.generator = torch.Generator().manual_seed(r.sampling.seed)
    return r


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = top_k_top_p_mask(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = top_k_top_p_mask(probs.log(), torch.tensor([0]), torch.tensor([0.8]))
    # 0.5 alone < 0.8, 0.5 + 0.3 reaches 0.8: keep exactly the first two.
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    out = top_k_top_p_mask(probs.log(), torch.tensor([0]), torch.tensor([0.81]))
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]


def test_seeded_sampling_repeats_and_differs_by_seed():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()

    def draw(seed):
        r = req(temperature=1.0, seed=seed)
        return [sampler(logits, [r]).token_ids[0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = Sampler()(logits, [req(temperature=0, logprobs=2)])
    assert out.token_ids == [1]
    lp = out.logprobs[0]
    expect = 2.0 - math.log(1 + math.e**2 + math.e)
    assert lp.logprob == pytest.approx(expect, abs=1e-5)
    assert [t for t, _ in lp.top] == [1, 2]


def test_penalties():
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]])
    r = Request("r", [3], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0))
    r.token_ids += [1, 1, 2]
    apply_penalties(logits, [r])
    # token 1: rep 1/2 then -2*0.25 - 0.5; token 2: 1/2 - 0.25 - 0.5; token 3 (prompt): -1*2.
    assert logits[0].tolist() == pytest.approx([1.0, -0.5, -0.25, -2.0, 1.0])


def test_temperature_sampling_follows_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.3)]])
    sampler = Sampler()
    r = req(temperature=1.0, seed=0)
    draws = [sampler(logits, [r]).token_ids[0] for _ in range(2000)]
    assert 0.65 < draws.count(0) / 2000 < 0.75


def test_logit_bias_moves_only_the_rows_that_ask_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    rows = [req(temperature=0, logit_bias={1: -100.0}, logprobs=0), req(temperature=0, logit_bias={0: 100.0}),
            req(temperature=0)]
    out = Sampler()(logits, rows)
    assert out.token_ids == [2, 0, 1]  # banned argmax, forced token, untouched row
    assert out.logprobs[0].logprob == pytest.approx(1.0 - math.log(1 + math.e**2 + math.e), abs=1e-5)
    assert logits.tolist() == [[0.0, 2.0, 1.0]] * 3  # the caller's logits are not changed
    seeded = req(temperature=1.0, seed=3, logit_bias={2: -100.0})
    assert all(Sampler()(logits[:1], [seeded]).token_ids[0] != 2 for _ in range(50))


@pytest.mark.parametrize("bias", [{-1: 1.0}, {1: 101.0}, {1: float("inf")}, {"1": 1.0}, [(1, 1.0)]])
def test_logit_bias_outside_the_api_range_is_refused(bias):
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_token_ids_past_the_vocabulary_are_refused():
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias={50: 1.0}).check_vocab(50)
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[50]).check_vocab(50)
    SamplingParams(logit_bias={49: 1.0}, stop_token_ids=[49]).check_vocab(50)
