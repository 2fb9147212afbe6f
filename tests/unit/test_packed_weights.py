"""Pre-packed fp32 weights (engine/quant.py `PackedWeight`): the same products as the
plain weights, the config rules, and an engine that packs generating what one that
does not generates."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine
from engine.quant import PackedWeight, matmul, packs_weights
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [(1,), (3,), (2, 8), (64,), (200,)])  # 1 and 200 rows: the plain copy
def test_a_packed_weight_multiplies_like_the_plain_one(rows):
    torch.manual_seed(0)
    w = torch.randn(576, 960)  # [in, out]
    x = torch.randn(*rows, 576)
    got = matmul(x, PackedWeight.pack(w))
    assert got.shape == (*rows, 960) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w, rtol=1e-5, atol=1e-4)


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


def test_an_engine_with_packed_weights_generates_what_one_without_does(base_engine):
    """base_engine packs (fp32 on the CPU, `auto`); this one does not. Batched decode
    and prefill go through the packed copy, batch-1 steps through the plain one."""
    plain = Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, packed_weights="off"))
    assert isinstance(base_engine.model.lm_head, PackedWeight)
    assert isinstance(plain.model.lm_head, torch.Tensor)
    prompts = [plain.tokenizer.encode(t) for t in ("The capital of France is", "Bees make honey by",
                                                     "Once upon a time, a fox", "Count to five: one,")]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def generate(engine: Engine) -> list[list[int]]:
        ids = [engine.add_request(p, sp) for p in prompts]
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[i] for i in ids]

    assert generate(base_engine) == generate(plain)
    text = plain.tokenizer.encode("The history of the Roman Empire spans many centuries.")
    torch.testing.assert_close(base_engine.score(text), plain.score(text), rtol=1e-4, atol=1e-3)
