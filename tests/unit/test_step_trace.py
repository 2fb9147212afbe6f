"""The engine's step trace (engine/step_trace.py): what it writes, reads back and sums."""

from __future__ import annotations

import pytest

from engine import step_trace
from engine.step_trace import StepRecord, StepTrace

pytestmark = pytest.mark.unit


def test_a_trace_is_off_without_the_variable_and_reads_back_what_it_wrote(tmp_path, monkeypatch):
    monkeypatch.delenv(step_trace.ENV, raising=False)
    assert StepTrace.from_env("decode") is None
    monkeypatch.setenv(step_trace.ENV, str(tmp_path / "steps"))
    trace = StepTrace.from_env("decode")
    assert trace is not None
    trace.record(10.0, 0.025, 2, 8)
    trace.record(10.03, 0.03, 1, 7)
    with trace.path.open("a") as f:
        f.write("10.07 0.0")  # a line cut short when the process was killed
    (name, records), = step_trace.read(tmp_path / "steps").items()
    assert step_trace.role_of(name) == "decode"
    assert records == [StepRecord(10.0, 0.025, 2, 8), StepRecord(10.03, 0.03, 1, 7)]
    trace.close()


def test_the_steady_state_runs_from_the_first_full_batch_to_the_last():
    # A ramp (batches 1..3), a steady stretch of 4 steps of 0.1 s at batch 4 or 3,
    # a tail; a step before the window is left out.
    steps = [StepRecord(0.0, 0.1, 2, 9)]
    steps += [StepRecord(1.0 + 0.1 * i, 0.1, 2, b) for i, b in enumerate([1, 2, 3, 4, 3, 4, 4, 2, 1])]
    s = step_trace.summarize(steps, start=0.5, end=2.5, full_batch=4)
    assert s["steps"] == 9 and s["threads"] == {"2": 9}
    assert s["busy"] == pytest.approx(0.9 / 2.0)
    steady = s["steady"]
    assert steady["seconds"] == pytest.approx(0.4)  # from the step at 1.3 to the end of the one at 1.6
    assert steady["outputs_per_s"] == pytest.approx(15 / 0.4)
    assert steady["mean_batch"] == pytest.approx(15 / 4)
    assert steady["busy"] == pytest.approx(1.0)
    assert steady["full_team"] == 1.0


def test_an_engine_that_never_fills_its_batch_has_no_steady_state():
    steps = [StepRecord(1.0, 0.1, 1, 1), StepRecord(1.1, 0.1, 2, 2)]
    s = step_trace.summarize(steps, 0.0, 2.0, full_batch=4)
    assert "steady" not in s and s["threads"] == {"1": 1, "2": 1}
    assert step_trace.summarize(steps, 5.0, 6.0, full_batch=1) == {"steps": 0}
