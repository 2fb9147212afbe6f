"""`duet bench`: one table of targets (cluster/cli.py), each a bench/ module named
after its target that parses its own flags. Nothing here runs a benchmark."""

from __future__ import annotations

import pytest

from cluster import cli

pytestmark = pytest.mark.unit

# The targets docs/benchmarks.md and the README name; none may go missing.
DOCUMENTED = {"engine", "serve", "efficiency", "kv", "cluster", "routing", "tracing", "autoscale", "startup",
              "structured", "speculative", "disaggregation", "choices", "move", "faults"}
# Studies, not tools an operator runs: scripts in scripts/experiments/, outside the package.
STUDIES = ("profile", "idle", "grammar", "phases", "packing")


def test_each_target_is_the_bench_module_of_its_name():
    assert set(cli.BENCH_TARGETS) == DOCUMENTED
    assert cli.BENCH_TARGETS == {name: f"bench.{name}" for name in cli.BENCH_TARGETS}


@pytest.mark.model  # a Python process per study
@pytest.mark.parametrize("study", STUDIES)
def test_a_study_is_a_script_with_its_own_flags(study):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "experiments" / f"{study}.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: scripts/experiments/{study}.py ")
    assert study not in cli.BENCH_TARGETS


@pytest.mark.parametrize("target", sorted(DOCUMENTED))
def test_each_target_owns_its_flags(target, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", target, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: duet bench {target} ")


def test_bench_help_and_a_wrong_target_list_the_table(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in DOCUMENTED)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(repr(name) in err for name in DOCUMENTED)


def test_autoscale_live_picks_the_live_mode_and_its_flags(monkeypatch):
    from bench import autoscale

    seen = []
    monkeypatch.setattr(autoscale, "main_live", lambda args: seen.append(("live", args)) or 0)
    monkeypatch.setattr(autoscale, "main_simulated", lambda args: seen.append(("simulated", args)) or 0)
    assert cli.main(["bench", "autoscale", "--rate", "0.5", "--seeds", "1"]) == 0
    assert cli.main(["bench", "autoscale", "--quiet-rate", "0.6", "--live", "--prompt-tokens", "512"]) == 0
    (sim_mode, sim), (live_mode, live) = seen
    assert (sim_mode, sim.rate, sim.seeds) == ("simulated", 0.5, [1])
    assert (live_mode, live.quiet_rate, live.prompt_tokens) == ("live", 0.6, 512)
    with pytest.raises(SystemExit):  # a live flag is not a simulated one
        cli.main(["bench", "autoscale", "--quiet-rate", "0.6"])
