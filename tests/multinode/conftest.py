"""A three-node Ray cluster in network namespaces (cluster/netns.py) for the whole
session, a Redis on its bridge, and duet deployed on it the way an operator does:
`duet serve --address` run inside the head node's namespace.

Needs root and iproute2 (the suite runs as root in CI); skipped otherwise. The
cluster uses its own names and subnet, so a developer's `duet cluster netns up`
cluster (duet-*, 10.77.0.0/24) is left alone.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import pytest
from mn_cluster import CHAT, MAX_TOKENS, REDIS_PORT, REPO
from sse import data_events

from cluster import netns


@pytest.fixture(scope="session")
def mn():
    why = netns.available()
    if why:
        pytest.skip(why)
    c = netns.NamespaceCluster(prefix="duett", subnet="10.78.0")
    c.stop()  # what a killed run left behind
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def mn_redis(mn, tmp_path_factory):
    """Redis on the bridge (the root namespace): every node reaches it over the network."""
    env = dict(os.environ, DUET_REDIS_HOST=mn.bridge_ip, DUET_REDIS_PORT=str(REDIS_PORT),
               DUET_REDIS_DIR=str(tmp_path_factory.mktemp("mn-redis")))
    script = [str(REPO / "scripts" / "redis.sh")]
    out = subprocess.run(script + ["start"], env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        pytest.fail(f"Redis did not start on {mn.bridge_ip}:{REDIS_PORT}: {out.stdout}{out.stderr}")
    yield f"redis://{mn.bridge_ip}:{REDIS_PORT}"
    subprocess.run(script + ["stop"], env=env, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Reference:
    text: str
    prompt_tokens: int


@pytest.fixture(scope="session")
def reference() -> Reference:
    """The single-process fp32 engine's greedy answer to `CHAT`."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024))
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}],
                                                                       add_generation_prompt=True))
    (res,) = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return Reference(res.text, len(ids))


@pytest.fixture(scope="session")
def chat():
    """`chat(url, stream=False, content=CHAT)` -> (text, prompt tokens), greedy."""
    import httpx

    def run(url: str, stream: bool = False, content: str = CHAT, timeout: float = 120) -> tuple[str, int]:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}],
                "max_tokens": MAX_TOKENS, "temperature": 0}
        if not stream:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
            r.raise_for_status()
            data = r.json()
            return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens"]
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        text, prompt_tokens = "", -1
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            r.raise_for_status()
            for event in data_events(r):
                for choice in event.get("choices", []):
                    text += choice["delta"].get("content") or ""
                if event.get("usage"):
                    prompt_tokens = event["usage"]["prompt_tokens"]
        return text, prompt_tokens

    return run
