"""One fp32 model per test session; each test builds cheap engines around it."""

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine

_HERE = Path(__file__).parent
# Fixtures that load the model: a test that takes one (directly or not) is a `model` test.
MODEL_FIXTURES = {"base_engine"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Every test under tests/unit/ is a unit test, marked or not: CI selects the unit
    # step with `-m unit`, and a file that forgot its marker was silently skipped.
    # One that runs the real model (through the session's weights) is a `model` test
    # too: `-m "unit and not model"` is the pure logic, in seconds; `-m model` the rest
    # (scripts/test.sh runs them as two stages).
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.unit)
            if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def base_engine() -> Engine:
    # One thread: with two, a second busy process on these 2-core machines makes the
    # OpenMP threads spin against each other and the suite ~8x slower.
    torch.set_num_threads(1)
    return Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=512))


@pytest.fixture
def make_engine(base_engine):
    """Engine(**overrides) sharing the session's weights, with a fresh KV pool."""

    def make(role="aggregated", **overrides) -> Engine:
        cfg = EngineConfig(**{"dtype": "float32", "device": "cpu", "num_kv_blocks": 512, **overrides})
        return Engine(cfg, role=role, model=base_engine.model)

    return make


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()
