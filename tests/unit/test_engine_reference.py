"""Our forward against Hugging Face transformers on the same GGUF weights (fp32)."""

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.weights import embedded_gguf_path

pytestmark = pytest.mark.unit

LONG_TEXT = (
    "The history of the city of Paris spans more than two thousand years. It began as a small "
    "settlement of the Parisii, a Celtic tribe, on an island in the Seine. The Romans conquered "
    "the area and built a town called Lutetia, with baths, a forum and an amphitheatre. In the "
    "Middle Ages Paris became the largest city in Europe, home to a great university, to the "
    "cathedral of Notre-Dame and to the royal court. The Revolution of 1789 began in its streets, "
    "and in the nineteenth century Baron Haussmann rebuilt much of the centre with wide boulevards, "
    "parks and sewers. Today it is a centre of art, fashion, science and government, visited by "
    "millions of people every year who come to see its museums, its river and its bridges. "
    "Its metro, opened in 1900, carries more than four million passengers on a working day, and "
    "its airports connect it with every continent. The city is divided into twenty districts, "
    "called arrondissements, which spiral out from the centre like the shell of a snail."
)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    g = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    return model.eval()


def test_logits_match_transformers_on_long_prompt(base_engine, hf_model):
    ids = base_engine.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= 200
    ours = base_engine.score(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)


def test_greedy_continuation_matches_transformers(engine, hf_model):
    ids = engine.tokenizer.encode(LONG_TEXT)[:200]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    ref_tokens = ref[0, len(ids) :].tolist()
    ours = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    assert ours.token_ids == ref_tokens
