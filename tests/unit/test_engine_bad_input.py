"""Bad input is refused with an error naming the field; nothing else is lost."""

import pytest

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": 42}, "stop"),
        ({"stop": [None]}, "stop"),
        ({"top_k": -3}, "top_k"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        # Values that would overflow inside a batched step (one request must never
        # take the engine loop down): they are refused at admission.
        ({"top_k": 9223372036854775808}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_invalid_sampling_names_field(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)


def test_bad_prompts_refused_and_engine_keeps_serving(engine):
    free0 = engine.block_pool.num_free_blocks
    ok = engine.add_request("Count to five:", SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("", SamplingParams())
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([5] * engine.cfg.max_model_len, SamplingParams())
    assert err.value.field == "prompt" and "context length" in str(err.value)
    with pytest.raises(InvalidRequest):
        engine.add_request([10**9], SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.add_request("x", SamplingParams(max_tokens=1), request_id=ok)
    done = False
    while not done:
        done = any(o.request_id == ok and o.finished for o in engine.step())
    assert not engine.has_unfinished()
    assert engine.block_pool.num_free_blocks == free0
