"""The torch.distributed backend (gloo) between the prefill and decode nodes: each
side binds its node's own address, and greedy output is exact. Deployed from the
generated Serve config (`duet serve --address --config`)."""

from __future__ import annotations

import math

import pytest
import yaml
from mn_cluster import BYTES_PER_BLOCK, DuetServe, cluster_config, complete_unique, scrape, settled, total, wait_for

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def duet(mn, mn_redis, tmp_path_factory):
    path = tmp_path_factory.mktemp("torch") / "duet.yaml"
    path.write_text(yaml.safe_dump(cluster_config(mn, mn_redis, "torch")))
    d = DuetServe(mn, ["--config", str(path)], path.with_name("serve.log"))
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


def test_gloo_moves_the_kv_between_nodes_exactly(duet, mn, reference, chat):
    for stream in (False, True):
        text, prompt_tokens = chat(duet.url, stream=stream)
        assert text == reference.text
        assert prompt_tokens == reference.prompt_tokens
    before = settled(mn, "decode", "ray_duet_kv_transfer_bytes_total")
    prompt_tokens = complete_unique(duet.url)
    want = math.ceil(prompt_tokens / 16) * BYTES_PER_BLOCK  # no block of it cached anywhere: all of it moves

    def pulled() -> float:
        return (total(scrape(mn, "decode"), "ray_duet_kv_transfer_bytes_total", backend="torch")
                - total(before, "ray_duet_kv_transfer_bytes_total", backend="torch"))

    wait_for(lambda: pulled() == want, 30, f"{want} bytes pulled by gloo on the decode node")
