"""Router policy on snapshots: prefix affinity, hot-spot protection, determinism."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.hashing import block_hashes
from engine.kv_events import BlockStored
from kvtransfer.events.prefix_index import InProcessPrefixIndex
from routing.router.affinity import SessionAffinity
from routing.router.policy import (
    ReplicaSnapshot,
    RouterConfig,
    choose_decode,
    choose_prefill,
)

pytestmark = pytest.mark.unit

BS = 16
FP = "test-model"


def snap(rid, queued=0, running=0, free=100, total=100):
    return ReplicaSnapshot(rid, queued, running, free, total)


def test_prefix_goes_to_replica_holding_it():
    prompt = list(range(128))
    index = InProcessPrefixIndex()
    index.apply("b", [BlockStored(tuple(block_hashes(prompt, BS, FP)), None, 128)])
    snaps = [snap("a"), snap("b"), snap("c")]
    d = choose_prefill(len(prompt) + 5, snaps, index.match(block_hashes(prompt, BS, FP)), RouterConfig(), BS)
    assert (d.replica_id, d.cached_blocks, d.reason) == ("b", 8, "prefix")


def test_load_outweighs_small_prefix():
    cfg = RouterConfig(imbalance_threshold=1e9)
    snaps = [snap("a", queued=20 * BS), snap("b")]
    d = choose_prefill(4 * BS, snaps, {"a": 4}, cfg, BS)
    assert d.replica_id == "b" and d.reason == "load"


def test_imbalance_threshold_makes_load_decide():
    # 'a' holds the whole prompt but is far busier than 'b'.
    snaps = [snap("a", queued=100 * BS), snap("b")]
    cfg = RouterConfig(overlap_weight=10.0, imbalance_threshold=50)
    d = choose_prefill(64 * BS, snaps, {"a": 64}, cfg, BS)
    assert (d.replica_id, d.reason) == ("b", "imbalance")
    # Below the threshold the prefix still wins.
    cfg = RouterConfig(overlap_weight=10.0, imbalance_threshold=200)
    assert choose_prefill(64 * BS, snaps, {"a": 64}, cfg, BS).replica_id == "a"


def _simulate_hot_prompt(cfg, index_learns: bool, n=400, seed=0):
    """Two replicas, one hot system prompt cached on 'a', arrivals faster than
    one replica drains: returns the share of requests each replica took."""
    rng = random.Random(seed)
    system = list(range(10_000, 10_000 + 32 * BS))  # 32-block hot system prompt
    index = InProcessPrefixIndex()
    index.apply("a", [BlockStored(tuple(block_hashes(system, BS, FP)), None, len(system))])
    queued = {"a": 0, "b": 0}
    drain_per_step = 1 * BS  # arrivals need 2 blocks per step: one replica cannot keep up
    counts = Counter()
    for _ in range(n):
        prompt = system + [rng.randrange(1000) for _ in range(2 * BS)]
        hashes = block_hashes(prompt, BS, FP)
        snaps = [snap(r, queued=queued[r]) for r in ("a", "b")]
        d = choose_prefill(len(prompt), snaps, index.match(hashes), cfg, BS, rng=rng)
        counts[d.replica_id] += 1
        queued[d.replica_id] += len(prompt) - d.cached_blocks * BS
        if index_learns:
            index.apply(d.replica_id, [BlockStored(tuple(hashes), None, len(hashes) * BS)])
        for r in queued:
            queued[r] = max(0, queued[r] - drain_per_step)
    return {r: counts[r] / n for r in ("a", "b")}


@pytest.mark.parametrize("overlap_weight", [1.0, 16.0])
@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_hot_prompt_is_not_a_hot_spot(overlap_weight, temperature):
    cfg = RouterConfig(
        overlap_weight=overlap_weight, temperature=temperature, imbalance_threshold=48
    )
    share = _simulate_hot_prompt(cfg, index_learns=True)
    assert max(share.values()) <= 0.70, share


def test_without_imbalance_guard_a_heavy_overlap_weight_makes_a_hot_spot():
    # The contrast that shows the guard is what protects the test above.
    cfg = RouterConfig(overlap_weight=16.0, imbalance_threshold=1e9)
    assert _simulate_hot_prompt(cfg, index_learns=True)["a"] > 0.95


def test_hot_prompt_never_learned_elsewhere_still_spills_over():
    # Even if 'b' never reports the prefix, it is not left idle while 'a' queues.
    cfg = RouterConfig(overlap_weight=8.0, imbalance_threshold=48)
    assert _simulate_hot_prompt(cfg, index_learns=False)["b"] > 0


def test_temperature_zero_is_deterministic_with_stable_tie_break():
    cfg = RouterConfig(temperature=0.0)
    snaps = [snap("b"), snap("a"), snap("c")]
    picks = {choose_prefill(64, snaps, {}, cfg, BS).replica_id for _ in range(50)}
    assert picks == {"a"}  # ties break on replica id, not list order
    assert choose_prefill(64, list(reversed(snaps)), {}, cfg, BS).replica_id == "a"


def test_softmax_sampling_is_seeded_and_spreads():
    cfg = RouterConfig(temperature=4.0)
    snaps = [snap("a"), snap("b", queued=2 * BS)]
    run = lambda seed: [  # noqa: E731
        choose_prefill(64, snaps, {}, cfg, BS, rng=random.Random(seed)).replica_id for _ in range(1)
    ]
    assert run(7) == run(7)
    rng = random.Random(1)
    picks = Counter(choose_prefill(64, snaps, {}, cfg, BS, rng=rng).replica_id for _ in range(400))
    assert picks["a"] > picks["b"] > 0  # cheaper is likelier, not certain


def test_session_affinity_is_a_hint_not_a_rule():
    cfg = RouterConfig(session_affinity_bonus=8, imbalance_threshold=1e9)
    # Small load difference: the hint wins.
    d = choose_prefill(64, [snap("a"), snap("b", queued=4 * BS)], {}, cfg, BS, preferred_replica="b")
    assert (d.replica_id, d.reason) == ("b", "affinity")
    # Large load difference: the hint loses.
    d = choose_prefill(64, [snap("a"), snap("b", queued=40 * BS)], {}, cfg, BS, preferred_replica="b")
    assert d.replica_id == "a"


def test_session_affinity_table_lru_ttl_and_removal():
    now = [0.0]
    table = SessionAffinity(max_sessions=2, ttl_s=10, clock=lambda: now[0])
    table.record("s1", "a")
    table.record("s2", "b")
    table.record("s3", "a")  # evicts s1
    assert table.get("s1") is None and table.get("s2") == "b"
    table.remove_replica("a")
    assert table.get("s3") is None
    now[0] = 11
    assert table.get("s2") is None
    assert table.get(None) is None


def test_decode_by_free_kv_and_running():
    cfg = RouterConfig()
    snaps = [snap("a", running=4, free=90), snap("b", running=1, free=80), snap("c", running=0, free=9, total=10)]
    assert choose_decode(snaps, cfg, blocks_needed=10).replica_id == "b"  # c cannot fit
    assert choose_decode(snaps, cfg).replica_id == "c"
    d = choose_decode(snaps, cfg, blocks_needed=1000)
    assert (d.replica_id, d.reason) == ("a", "no-fit")


def test_a_replica_that_has_not_reported_yet_counts_as_empty():
    """A decode replica that just started has no report yet (total 0, free unlimited, as
    the routers fill it in): its KV pool is empty, so it wins over one already running
    a sequence, as it will once it reports."""
    cfg = RouterConfig()
    running = snap("old", running=1, free=230, total=256)
    new = snap("new", running=0, free=1 << 30, total=0)
    assert choose_decode([running, new], cfg, blocks_needed=10).replica_id == "new"
    assert choose_decode([running, snap("new", running=2, free=1 << 30, total=0)], cfg).replica_id == "old"


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="temperature"):
        RouterConfig(temperature=-1)
    with pytest.raises(ValueError, match="imbalance_threshold"):
        RouterConfig(imbalance_threshold=0)
    with pytest.raises(ValueError, match="no prefill replicas"):
        choose_prefill(10, [], {}, RouterConfig(), BS)
