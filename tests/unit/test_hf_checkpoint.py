"""A Hugging Face Llama directory (random weights, bench/random_checkpoint.py) through
our engine against transformers on the same weights: on the CPU, and on CUDA where
a GPU is present (tests skipped elsewhere)."""

import asyncio
import json
import shutil

import pytest
import torch

from bench.random_checkpoint import SHAPES, write_checkpoint
from engine.config import ConfigError, EngineConfig
from engine.core_client import EngineCoreClient
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from engine.weights import Checkpoint, _hf_config

pytestmark = [pytest.mark.unit, pytest.mark.model]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
PROMPT = "The history of the city of Paris spans more than two thousand years. " * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # std 0.3: logits spread widely enough that greedy choices are not near-ties that
    # rounding order alone could flip between two correct implementations.
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), SHAPES["tiny"], std=0.3, dtype=torch.float32)


def _engine(checkpoint, device: str, dtype: str) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), dtype=dtype, device=device, num_kv_blocks=64))


def _reference(checkpoint, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_logits_and_greedy_tokens_match_transformers(checkpoint, device):
    engine = _engine(checkpoint, device, "float32")
    ref = _reference(checkpoint, device, torch.float32)
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 200  # past one 16-token block many times over
    with torch.no_grad():
        want = ref(torch.tensor([ids], device=device)).logits[0].float()
        gen = ref.generate(torch.tensor([ids], device=device), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False)
    got = engine.score(ids)
    assert got.device.type == device
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    out = engine.generate([ids, ids[:50]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert out[0].token_ids == gen[0, len(ids):].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_track_transformers(checkpoint, device):
    engine = _engine(checkpoint, device, "bfloat16")
    ref = _reference(checkpoint, device, torch.bfloat16)
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        want = ref(torch.tensor([ids], device=device)).logits[0].float()
    got = engine.score(ids).float()
    # Two bf16 implementations round in different places (fused projections), so the
    # bound is relative to the logits' spread, and most argmaxes must agree.
    err = (got - want).abs().mean() / want.std()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert err < 0.05, f"mean error {err:.3f} of the logits' std"
    assert agree > 0.9, f"argmax agrees at {agree:.0%} of positions"


def _config_as_transformers5(src, dst):
    """The same checkpoint with its config in transformers 5's form (`rope_parameters`)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw["rope_parameters"] = {**raw.pop("rope_scaling"), "rope_theta": raw.pop("rope_theta")}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_both_config_forms_give_one_model_config(checkpoint, tmp_path):
    legacy = _hf_config(Checkpoint("m", checkpoint, "hf"))
    v5 = _hf_config(Checkpoint("m", _config_as_transformers5(checkpoint, tmp_path / "v5"), "hf"))
    assert legacy == v5
    assert legacy.rope_theta == 50000.0 and legacy.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_variants_are_refused_by_name(checkpoint, tmp_path, change, named):
    d = tmp_path / "variant"
    shutil.copytree(checkpoint, d)
    raw = json.loads((d / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=named):
        _hf_config(Checkpoint("m", d, "hf"))


@pytest.mark.parametrize("device", DEVICES)
def test_speculation_seeds_and_grammars_on_the_device(checkpoint, device):
    """The engine's per-request machinery on `device`: n-gram and draft-model
    speculation leave greedy tokens unchanged (the checkpoint drafting for itself is
    accepted every time), a seed reproduces its sample, a grammar's mask is applied."""
    plain = _engine(checkpoint, device, "float32")
    ids = plain.tokenizer.encode("alpha beta gamma delta " * 12)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = plain.generate([ids, ids[:30]], greedy)
    for method in ({"method": "ngram"}, {"method": "draft", "draft_model": str(checkpoint)}):
        spec = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device=device, num_kv_blocks=64,
                                   speculative={**method, "num_tokens": 4}))
        assert [o.token_ids for o in spec.generate([ids, ids[:30]], greedy)] == [o.token_ids for o in want]
    assert 0 < spec.num_accepted_tokens == spec.num_draft_tokens  # the draft model: itself

    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first, again = (plain.generate([ids, ids[:40]], seeded)[0].token_ids for _ in range(2))
    assert first == again

    choice = SamplingParams(max_tokens=8, temperature=0,
                            structured=StructuredOutput("choice", json.dumps(["yes", "no"])))
    assert plain.generate([ids], choice)[0].text in ("yes", "no")


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_core_child_process_on_the_device(checkpoint, device):
    """The aggregated pool's engine runs in a child process (engine/core_client.py);
    on a GPU the child, not the replica, owns the CUDA context."""
    cfg = EngineConfig(model=str(checkpoint), dtype="float32", device=device, num_kv_blocks=64)
    ids = Engine(cfg).tokenizer.encode(PROMPT)[:60]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = _engine(checkpoint, device, "float32").generate([ids], greedy)[0].token_ids

    async def run() -> list[int]:
        client = EngineCoreClient(cfg, "aggregated", threads=1)
        try:
            stream = await client.add_request("r", ids, greedy)
            return [t async for outs in stream for o in outs for t in o.new_token_ids]
        finally:
            client.shutdown()

    assert asyncio.run(run()) == want
