"""The image the Helm chart runs (deploy/Containerfile), booted from its own file system.

1. `duet serve` from the image, on this host's network, aggregated and disaggregated,
   answers a chat through the `openai` client with the in-process engine's greedy text.
2. A three-node Ray cluster in network namespaces whose nodes run from the image (its
   Python, Ray and duet; `ray start` with the rendered chart's own rayStartParams, the
   gateway on the head's node group) serves the chart's rendered serveConfigV2.

Slow (the image, then model loads on 2 cores), so not in every CI run: `make image-test`
or `DUET_IMAGE_TEST=1 make test` runs them, after `make image`.
"""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest
import yaml
from mn_cluster import stop_serve, wait_serve_ready  # tests/multinode: on sys.path by conftest.py

from cluster import netns
from engine.weights import SMOLLM2_ID

pytestmark = pytest.mark.image

PORT = 8041  # not 8000 (demo), 8011 (e2e) nor 8031 (loadgen e2e)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "num_kv_blocks": 128}


@pytest.fixture(scope="module")
def reference() -> str:
    """The single-process fp32 engine's greedy answer (this environment's engine)."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(**{**ENGINE, "num_kv_blocks": 64}))
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    (res,) = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return res.text


def ask(base_url: str) -> str:
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    r = c.chat.completions.create(model=SMOLLM2_ID, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].message.content or ""


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_duet_serve_from_the_image_answers_a_chat(image_root, mode, reference, tmp_path):
    cfg = {"mode": mode, "engine": ENGINE, "gateway": {"port": PORT}}
    (image_root / "tmp" / f"duet-{mode}.yaml").write_text(yaml.safe_dump(cfg))
    image = netns.NamespaceCluster(rootfs=image_root)  # only for its chroot argv and environment
    argv = image.chroot_argv([image.executable("duet"), "serve", "--config", f"/tmp/duet-{mode}.yaml",
                              "--ready-timeout", "600"])
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(argv, env=image.node_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{PORT}"
        wait_serve_ready(url, proc, log, timeout_s=600)
        assert ask(url) == reference
    finally:
        stop_serve(proc, timeout_s=120)
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_three_namespace_nodes_from_the_image_serve_the_rendered_chart(image_root, reference, tmp_path):
    helm_chart = pytest.importorskip("helm_chart", reason="the chart tests' helpers (tests/helm_chart.py)")
    from mn_cluster import HTTP_PORT, DuetServe

    why = netns.available()
    if why:
        pytest.skip(why)
    values = helm_chart.load_values(helm_chart.CHART / "examples" / "cpu-small.yaml")
    values["duet"] = {
        "engine": ENGINE,
        "prefill": {"node_group": "prefill", "num_cpus": 1, "threads": 1},
        "decode": {"node_group": "decode", "num_cpus": 1, "threads": 1},
        "transfer": {"backend": "nixl", "ucx_tls": "tcp,self"},
        "router": {"prefix_index": "memory"},
        "gateway": {"host": "0.0.0.0", "port": HTTP_PORT},
    }
    values["redis"] = {"enabled": False}
    objects = helm_chart.render(values)
    (image_root / "tmp" / "serveConfigV2.yaml").write_text(yaml.safe_dump(helm_chart.serve_config_v2(objects)))

    mn = netns.NamespaceCluster(nodes=helm_chart.namespace_nodes(objects), prefix="dueti", subnet="10.80.0",
                                rootfs=image_root)
    mn.stop()  # what a killed run left behind
    serve = None
    try:
        mn.start()
        serve = DuetServe(mn, ["--serve-config", "/tmp/serveConfigV2.yaml", "--ready-timeout", "600"],
                          tmp_path / "serve.log")
        serve.wait_ready(timeout_s=600)
        assert ask(serve.url) == reference
        assert [m["id"] for m in httpx.get(f"{serve.url}/v1/models", timeout=30).json()["data"]] == [SMOLLM2_ID]
    finally:
        if serve is not None:
            serve.stop()
        mn.stop()
