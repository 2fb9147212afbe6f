"""The prefill → decode handoff on a real cluster: the bytes NIXL moved, and the three
ends of a lease (release, reject, expiry) with both block pools back at baseline."""

from __future__ import annotations

import uuid

import openai
import pytest
from duet_cluster import BYTES_PER_BLOCK, blocks_for, wait_for, wait_idle

from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import SMOLLM2_ID
from kvtransfer.messages import DecodeRequest, PrefillRequest

pytestmark = pytest.mark.integration


def client(duet) -> openai.OpenAI:
    return openai.OpenAI(base_url=duet.base_url, api_key="unused", max_retries=0, timeout=120)


def unique_prompt(words: int) -> str:
    """A prompt no earlier request cached (the prefix hash covers its first block)."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"word{i}" for i in range(words))


@pytest.mark.cluster("nixl")
@pytest.mark.parametrize("words", [3, 40, 200])
def test_nixl_moves_blocks_times_bytes_per_block(duet, words):
    wait_idle(duet)
    before = duet.stats("decode")
    r = client(duet).completions.create(model=SMOLLM2_ID, prompt=unique_prompt(words), max_tokens=3, temperature=0)
    after = duet.stats("decode")
    n_blocks = blocks_for(r.usage.prompt_tokens)
    assert after["transfer_count"] - before["transfer_count"] == 1
    assert after["transfer_blocks"] - before["transfer_blocks"] == n_blocks
    assert after["transfer_bytes"] - before["transfer_bytes"] == n_blocks * BYTES_PER_BLOCK
    assert after["transfer_seconds"] > before["transfer_seconds"]
    assert after["imports"] - before["imports"] == 1
    assert after["transfer_failures"] == before["transfer_failures"]
    wait_idle(duet)


@pytest.mark.cluster("nixl")
def test_release_leaves_blocks_as_prefix_cache(duet):
    wait_idle(duet)
    prompt = unique_prompt(60)
    before = duet.stats("prefill")
    c = client(duet)
    first = c.completions.create(model=SMOLLM2_ID, prompt=prompt, max_tokens=4, temperature=0)
    wait_for(lambda: duet.stats("prefill")["leases_released"] == before["leases_released"] + 1, 10,
             what="decode's Release")
    wait_idle(duet)
    p = duet.stats("prefill")
    assert p["leases_granted"] == before["leases_granted"] + 1
    assert (p["leases_rejected"], p["leases_expired"]) == (before["leases_rejected"], before["leases_expired"])
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    second = c.completions.create(model=SMOLLM2_ID, prompt=prompt, max_tokens=4, temperature=0)
    n = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0 and cached >= (n - 1) // 16 * 16 - 16
    assert second.choices[0].text == first.choices[0].text
    assert duet.stats("prefill")["prefix_cache_hit_rate"] > 0
    wait_idle(duet)


@pytest.mark.cluster("traced")
def test_lease_expires_when_decode_never_pulls(duet):
    wait_idle(duet)
    ids = load_tokenizer(duet.cfg.engine.model).encode(unique_prompt(30))
    before = duet.stats("prefill")
    rid = f"ttl-{uuid.uuid4().hex[:8]}"
    sp = SamplingParams(max_tokens=8, temperature=0)
    result = duet.handle("prefill").prefill.remote(PrefillRequest(rid, tuple(ids), sp)).result(timeout_s=60)
    handle = result.kv_handle
    assert handle is not None and handle.num_blocks == blocks_for(len(ids))

    held = duet.stats("prefill")
    if handle.seconds_left() > 0.5:  # a busy shared machine may already be past the TTL
        assert held["leases_active"] == 1
        assert held["kv_blocks_free"] == before["kv_blocks_free"] - handle.num_blocks

    wait_for(lambda: duet.stats("prefill")["leases_expired"] == before["leases_expired"] + 1,
             timeout=duet.cfg.transfer.lease_ttl_s + 10, what="the lease to expire")
    wait_idle(duet)
    p = duet.stats("prefill")
    assert (p["leases_released"], p["leases_rejected"]) == (before["leases_released"], before["leases_rejected"])

    # A late pull of the expired handle is refused, never served from reused blocks:
    # decode computes the prompt itself (`transfer.on_failure: recompute`, the default).
    d0 = duet.stats("decode")
    req = DecodeRequest(rid, tuple(ids), result.first_token, sp, handle)
    outs = [out for batch in duet.handle("decode").options(stream=True).generate.remote(req) for out in batch]
    assert outs[-1].finished and outs[-1].num_output_tokens == sp.max_tokens
    d1 = duet.stats("decode")
    assert d1["import_failures"] == d0["import_failures"] + 1
    assert d1["import_recomputes"] == d0["import_recomputes"] + 1
    assert d1["transfer_count"] == d0["transfer_count"]
    wait_idle(duet)


@pytest.mark.cluster("traced")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_decode_rejects_when_full_and_prefill_frees_at_once(duet, stream):
    wait_idle(duet)
    c = client(duet)
    prompt = unique_prompt(150)  # > TRACED_DECODE_BLOCKS blocks: more than the whole decode pool
    p0, d0 = duet.stats("prefill"), duet.stats("decode")
    with pytest.raises(openai.APIError) as err:
        if stream:
            for _ in c.completions.create(model=SMOLLM2_ID, prompt=prompt, max_tokens=8, temperature=0, stream=True):
                pass
        else:
            c.completions.create(model=SMOLLM2_ID, prompt=prompt, max_tokens=8, temperature=0)
    assert "no free KV blocks" in str(err.value) or "no_free_blocks" in str(err.value), str(err.value)
    if not stream:
        assert isinstance(err.value, openai.APIStatusError) and err.value.status_code == 503  # capacity, retryable

    # The lease ends one of two ways: decode's Reject, or its TTL. Wait for either (no
    # wall-clock bound: a loaded machine is slower to tell, not wrong), then check it was
    # the Reject, which frees the blocks at once, and not the TTL.
    def lease_ended() -> bool:
        s = duet.stats("prefill")
        return s["leases_rejected"] > p0["leases_rejected"] or s["leases_expired"] > p0["leases_expired"]

    wait_for(lease_ended, timeout=60, what="prefill's lease to end")
    wait_idle(duet)
    p, d = duet.stats("prefill"), duet.stats("decode")
    # On a loaded machine a first lease (3 s here) may near its end before decode checks
    # it: decode refuses it (an import failure, which rejects it or finds it expired) and
    # the gateway prefills again. Exactly one lease was refused for want of blocks, and
    # it was rejected: only a failed pass's lease may have run to its TTL.
    assert d["import_rejects"] == d0["import_rejects"] + 1
    failed = d["import_failures"] - d0["import_failures"]
    rejected = p["leases_rejected"] - p0["leases_rejected"]
    expired = p["leases_expired"] - p0["leases_expired"]
    assert rejected + expired == 1 + failed, (rejected, expired, failed)
    assert expired <= failed, "the lease refused for want of blocks ran to its TTL: the Reject came too late"
    assert d["transfer_count"] == d0["transfer_count"]

    # A prompt that fits the decode pool is still served.
    ok = c.completions.create(model=SMOLLM2_ID, prompt="Hello", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
    wait_idle(duet)
