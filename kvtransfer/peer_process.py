"""A prefill-side backend in a child OS process, for integration tests and the benchmark.

Real transfers need two processes (NIXL agents and gloo ranks are per process), but
not Ray: the child fills a KV tensor from a seed, registers it with a backend, sends
its ``PeerInfo`` back over a pipe and serves until stopped or killed.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.backends import PeerInfo, make_backend

_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class KVSpec:
    """Shape and dtype of a test KV tensor in the engine's layout."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=getattr(torch, self.dtype))

    def filled(self, seed: int) -> torch.Tensor:
        """Deterministic random contents, so the receiver can rebuild what it expects."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.shape, generator=gen).to(getattr(torch, self.dtype))


def _serve(conn: Any, backend: str, spec: KVSpec, model_id: str, seed: int, backend_kw: dict) -> None:
    torch.set_num_threads(1)  # copies with 2 threads on 2 cores were 10x slower (measured)
    kv = spec.filled(seed)
    with make_backend(backend, "prefill", model_id, **backend_kw) as b:
        b.register(kv)
        b.expect_reads(math.inf)  # it serves reads, unleased, until told to stop
        conn.send(b.peer_info())
        conn.recv()  # anything, or EOF when the parent dies: stop


class PrefillPeer:
    """Owns one child process serving a filled KV tensor through ``backend``."""

    def __init__(
        self, backend: str, spec: KVSpec, *, model_id: str = "test-model", seed: int = 0, **backend_kw: Any
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child_conn, backend, spec, model_id, seed, backend_kw), daemon=True
        )
        self.process.start()
        child_conn.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise TimeoutError(f"{backend} prefill peer did not start within {_START_TIMEOUT_S}s")
        self.peer_info: PeerInfo = self._conn.recv()

    def signal(self, sig: int) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process must wake to die promptly
        self.signal(signal.SIGKILL)
        self.process.join(timeout=10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> PrefillPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
