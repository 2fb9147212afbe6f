"""Pre-packed fp32 weights (engine/quant.py `PackedWeight`): the same products as the
plain weights, the config rules, and an engine that packs generating what one that
does not generates."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine
from engine.quant import PackedWeight, keeps_dense_copy, matmul, packs_weights
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.model]


@pytest.mark.parametrize("keep_dense", [True, False])
@pytest.mark.parametrize("rows", [(1,), (3,), (2, 8), (64,), (200,)])  # 1 and 200 rows: the plain copy, if kept
def test_a_packed_weight_multiplies_like_the_plain_one(rows, keep_dense):
    torch.manual_seed(0)
    w = torch.randn(576, 960)  # [in, out]
    x = torch.randn(*rows, 576)
    packed = PackedWeight.pack(w, keep_dense)
    assert (packed.dense is not None) == keep_dense
    got = matmul(x, packed)
    assert got.shape == (*rows, 960) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w, rtol=1e-5, atol=1e-4)


def test_the_plain_copy_is_kept_on_one_thread_only():
    assert keeps_dense_copy(1)
    assert not keeps_dense_copy(2) and not keeps_dense_copy(8)


def test_auto_packs_fp32_on_the_cpu_only_and_on_elsewhere_is_an_error():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN")
    assert packs_weights("auto", "cpu", torch.float32, "none")
    assert not packs_weights("off", "cpu", torch.float32, "none")
    assert not packs_weights("auto", "cpu", torch.bfloat16, "none")
    assert not packs_weights("auto", "cpu", torch.bfloat16, "int8")
    assert not packs_weights("auto", "cuda", torch.float32, "none")
    with pytest.raises(ConfigError, match="packed_weights"):
        packs_weights("on", "cuda", torch.float32, "none")


@pytest.fixture(scope="module")
def plain_engine() -> Engine:
    return Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, packed_weights="off"))


@pytest.fixture(scope="module")
def two_thread_engine() -> Engine:
    """Loaded as on two threads (the packed copy only, for every product), then run on
    the suite's one thread (tests/unit/conftest.py says why): the products are the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, packed_weights="on"))
    finally:
        torch.set_num_threads(threads)
    return engine


SCORED = "The history of the Roman Empire spans many centuries."


def _generate(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    """Every prompt's tokens, the prompts in one batch."""
    ids = [engine.add_request(p, sp) for p in prompts]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[i] for i in ids]


@pytest.mark.parametrize("packed", ["base_engine", "two_thread_engine"])
def test_an_engine_with_packed_weights_generates_what_one_without_does(packed, plain_engine, request):
    """base_engine packs (fp32 on the CPU, `auto`) on one thread, keeping the plain copy
    for batch-1 steps; two_thread_engine keeps only the packed copy. The engine that
    does not pack generates the same tokens and scores."""
    packed_engine, plain = request.getfixturevalue(packed), plain_engine
    assert isinstance(packed_engine.model.lm_head, PackedWeight)
    assert (packed_engine.model.lm_head.dense is None) == (packed == "two_thread_engine")
    assert isinstance(plain.model.lm_head, torch.Tensor)
    prompts = [plain.tokenizer.encode(t) for t in ("The capital of France is", "Bees make honey by",
                                                     "Once upon a time, a fox", "Count to five: one,")]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert _generate(packed_engine, prompts, sp) == _generate(plain, prompts, sp)
    text = plain.tokenizer.encode(SCORED)
    torch.testing.assert_close(packed_engine.score(text), plain.score(text), rtol=1e-4, atol=1e-3)


def test_a_team_resized_between_layers_computes_what_a_steady_one_does(two_thread_engine):
    """An engine core that shares its cores (engine/core_share.py) changes its team
    between two layers of one step. The products do not depend on the team: the same
    tokens and scores as a team that never changes, and the hook runs between every
    two layers."""
    engine = two_thread_engine
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "Count to five: one,")]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    text = engine.tokenizer.encode(SCORED)

    def run() -> tuple[list[list[int]], torch.Tensor]:
        return _generate(engine, prompts, sp), engine.score(text)

    steady_tokens, steady_scores = run()
    threads = torch.get_num_threads()
    calls = 0

    def resize() -> None:
        nonlocal calls
        calls += 1
        torch.set_num_threads(1 + calls % 2)

    engine.model.between_layers = resize
    try:
        tokens, scores = run()
    finally:
        engine.model.between_layers = None
        torch.set_num_threads(threads)
    assert tokens == steady_tokens
    torch.testing.assert_close(scores, steady_scores, rtol=1e-4, atol=1e-3)
    forwards = calls // (engine.model.cfg.num_layers - 1)
    assert calls == forwards * (engine.model.cfg.num_layers - 1) and forwards >= 10
