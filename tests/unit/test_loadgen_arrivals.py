"""Arrival processes, length distributions and workload reproducibility."""

import json
import math

import numpy as np
import pytest

from loadgen.arrivals import ArrivalProcess, inter_arrival_gaps, sweep
from loadgen.distributions import parse_length
from loadgen.prompts import PromptBuilder
from loadgen.testing import WordTokenizer
from loadgen.workloads import WorkloadSpec, build_sessions, num_requests

pytestmark = pytest.mark.unit


def test_poisson_mean_rate_within_tolerance():
    gaps = inter_arrival_gaps(rate=4.0, n=20000, seed=1)
    assert gaps[0] == 0.0
    assert 1.0 / gaps[1:].mean() == pytest.approx(4.0, rel=0.03)
    cv = gaps[1:].std() / gaps[1:].mean()
    assert cv == pytest.approx(1.0, rel=0.05)  # exponential gaps
    assert np.array_equal(gaps, inter_arrival_gaps(4.0, 20000, seed=1))


def test_gamma_burstiness_keeps_rate_and_changes_variability():
    bursty = inter_arrival_gaps(4.0, 20000, burstiness=0.25, seed=2)[1:]
    smooth = inter_arrival_gaps(4.0, 20000, burstiness=4.0, seed=2)[1:]
    for g in (bursty, smooth):
        assert 1.0 / g.mean() == pytest.approx(4.0, rel=0.05)
    # CV of a gamma with shape k is 1/sqrt(k)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)


def test_infinite_rate_and_sweeps():
    assert not inter_arrival_gaps(math.inf, 5).any()
    assert [a.label for a in sweep([1.0, 2.0])] == ["rate=1", "rate=2"]
    assert [a.concurrency for a in sweep(concurrencies=[1, 4])] == [1, 4]
    with pytest.raises(ValueError):
        sweep([1.0], [2])
    with pytest.raises(ValueError):
        ArrivalProcess(rate=1.0, concurrency=2)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert (parse_length("7").sample(rng, 10) == 7).all()
    u = parse_length("uniform:10:20").sample(rng, 5000)
    assert u.min() == 10 and u.max() == 20
    n = parse_length("normal:100:500").sample(rng, 5000)
    assert n.min() >= 1  # clipped: never zero tokens
    ln = parse_length("lognormal:200:0.5").sample(rng, 20000)
    assert ln.mean() == pytest.approx(200, rel=0.03)
    with pytest.raises(ValueError):
        parse_length("zipf:1:2")


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn", "long-in-short-out", "short-in-long-out"])
def test_workloads_identical_under_same_seed(kind):
    spec = WorkloadSpec(kind, num_prompts=12, seed=7, think_time_s=0.5, prefix_len=16)
    a = build_sessions(spec, PromptBuilder(WordTokenizer()))
    b = build_sessions(spec, PromptBuilder(WordTokenizer()))
    c = build_sessions(WorkloadSpec(kind, num_prompts=12, seed=8, think_time_s=0.5, prefix_len=16),
                       PromptBuilder(WordTokenizer()))
    assert a == b and a != c
    assert num_requests(a) == 12


def test_prompt_lengths_and_shapes():
    tok = WordTokenizer()
    pb = PromptBuilder(tok)
    s = build_sessions(WorkloadSpec("random", 20, parse_length("uniform:5:50"), parse_length("3")), pb)
    assert all(len(tok.encode(x.turns[0].prompt)) == x.turns[0].prompt_tokens for x in s)
    shared = build_sessions(WorkloadSpec("shared-prefix", 40, num_prefixes=2, prefix_len=8, share_ratio=1.0), pb)
    assert len({x.system_prompt for x in shared}) == 2
    mt = build_sessions(WorkloadSpec("multi-turn", 10, turns=parse_length("4"), think_time_s=1.0), pb)
    assert [len(x.turns) for x in mt] == [4, 4, 2]
    assert all(x.turns[0].think_time_s == 0 for x in mt)


def test_trace_replay(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 12.0, "prompt_tokens": 5, "output_tokens": 3},
            {"timestamp": 10.5, "prompt": "hello there world", "output_length": 2}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    s = build_sessions(WorkloadSpec("trace", 10, trace_path=str(trace)), PromptBuilder(WordTokenizer()))
    assert [x.arrival_s for x in s] == [0.0, 1.5]
    assert s[0].turns[0].prompt == "hello there world" and s[0].turns[0].prompt_tokens == 3
    assert (s[1].turns[0].prompt_tokens, s[1].turns[0].output_tokens) == (5, 3)


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn"])
def test_prompt_variants_differ_in_words_only(kind):
    spec = WorkloadSpec(kind, num_prompts=12, seed=7, think_time_s=0.5, prefix_len=16, share_ratio=0.5)
    pb = PromptBuilder(WordTokenizer())
    a, b = build_sessions(spec, pb, variant=0), build_sessions(spec, pb, variant=1)
    shape = lambda ss: [(s.system_prompt_tokens, [(t.prompt_tokens, t.output_tokens, t.think_time_s)  # noqa: E731
                                                 for t in s.turns]) for s in ss]
    assert shape(a) == shape(b)
    assert not {t.prompt for s in a for t in s.turns} & {t.prompt for s in b for t in s.turns}
    assert build_sessions(spec, pb, variant=1) == b
