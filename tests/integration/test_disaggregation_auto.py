"""`router.disaggregation: auto` on a real disaggregated cluster (the fuzzer's): a short
prompt is prefilled on the decode replica (no lease granted, no transfer) and a long
one goes through the prefill pool; a conversation's next turn, too long for the local
limit on its own, is computed on the decode replica that holds its earlier turn (the
decode replicas' KV events price it); every answer is greedy-exact against the
single-process engine, and the gateway counts each placement."""

from __future__ import annotations

import pytest
import torch
from duet_cluster import (
    AUTO_LOCAL_MAX_TOKENS,
    BLOCK_SIZE,
    FUZZ_MAX_TOKENS,
    cached_tokens,
    complete,
    gateway_counter,
    prompt,
    wait_for,
    wait_idle,
)

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.cluster("fuzz")]

SHORT = prompt(AUTO_LOCAL_MAX_TOKENS - 4, 8801)
LONG = prompt(AUTO_LOCAL_MAX_TOKENS + 40, 8802)
# A first turn computed on decode, and the next one: 30 tokens more, past the local
# limit as a whole, but all except 42 of them (3 blocks) are held there.
FIRST = prompt(AUTO_LOCAL_MAX_TOKENS - 4, 8803)
NEXT = FIRST + prompt(30, 8804)


@pytest.fixture(scope="session")  # as test_cluster_api.py's: computed once, not per config group
def reference() -> dict[tuple[int, ...], str]:
    """The single-process fp32 engine's greedy text for each prompt."""
    torch.set_num_threads(1)  # the replicas use the other core
    engine = Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256))
    sp = SamplingParams(max_tokens=FUZZ_MAX_TOKENS, temperature=0)
    return {tuple(ids): engine.generate([ids], sp)[0].text for ids in (SHORT, LONG, FIRST, NEXT)}


@pytest.mark.parametrize("ids, where", [(SHORT, "local"), (LONG, "remote")], ids=["short", "long"])
def test_auto_places_each_prompt_and_both_are_exact(duet, reference, ids, where):
    wait_idle(duet)
    p0, d0 = duet.stats("prefill"), duet.stats("decode")
    placed0 = gateway_counter(duet, "duet_disaggregation_decisions_total", where=where)
    body = complete(duet, ids, max_tokens=FUZZ_MAX_TOKENS)
    p1, d1 = duet.stats("prefill"), duet.stats("decode")
    assert body["choices"][0]["text"] == reference[tuple(ids)]
    assert body["usage"]["completion_tokens"] == FUZZ_MAX_TOKENS
    granted, transfers = p1["leases_granted"] - p0["leases_granted"], d1["transfer_count"] - d0["transfer_count"]
    assert (granted, transfers) == ((0, 0) if where == "local" else (1, 1))
    assert gateway_counter(duet, "duet_disaggregation_decisions_total", where=where) == placed0 + 1
    wait_idle(duet)


def test_a_conversation_goes_on_where_its_earlier_turn_is_cached(duet, reference):
    wait_idle(duet)
    first = complete(duet, FIRST, max_tokens=FUZZ_MAX_TOKENS)
    assert first["choices"][0]["text"] == reference[tuple(FIRST)]
    held = len(FIRST) // BLOCK_SIZE
    # The replica the request comes in on prices a local prefill from its own KV events:
    # the first turn's blocks among them once the engine has reported them.
    wait_for(lambda: duet.stats("decode")["kv_events_cached_blocks"] >= held, 30,
             what="the decode replica's KV events to hold the first turn")
    p0 = duet.stats("prefill")
    placed0 = gateway_counter(duet, "duet_disaggregation_decisions_total", where="local", reason="cheaper_local")
    body = complete(duet, NEXT, max_tokens=FUZZ_MAX_TOKENS)
    placed = {k: v for k, v in _placements(duet).items() if v}
    assert gateway_counter(duet, "duet_disaggregation_decisions_total", where="local",
                           reason="cheaper_local") == placed0 + 1, placed
    assert body["choices"][0]["text"] == reference[tuple(NEXT)]
    assert cached_tokens(body) == held * BLOCK_SIZE  # the first turn's full blocks, from decode's cache
    assert duet.stats("prefill")["leases_granted"] == p0["leases_granted"]
    wait_idle(duet)


def _placements(duet) -> dict[tuple[str, str], float]:
    return {(where, reason): gateway_counter(duet, "duet_disaggregation_decisions_total", where=where, reason=reason)
            for where in ("local", "remote")
            for reason in ("short_prompt", "long_prompt", "decode_full", "cheaper_local", "cheaper_remote")}
