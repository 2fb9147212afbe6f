"""The paged KV cache tensor of one replica.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(block-major): one block is one contiguous region of `bytes_per_block`, which is
what the transfer backends and the LMCache connector move. Attention reads it
through per-layer strided views and never copies the pool.

A replica whose engine runs in a child process (engine/core_process.py) still
registers this tensor with its transfer backend in its own process, so the child
allocates it in shared memory (`shared=True`: an anonymous memfd, not /dev/shm,
whose size a container caps), hands the memfd to the replica over their Unix socket
(`SharedKV.send` / `SharedKV.receive`: SCM_RIGHTS, so neither /proc of another process
nor a name in a shared file system is involved), and the replica maps the same pages.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for(cfg: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_bytes is not None:
        n = cfg.kv_cache_bytes // bytes_per_block(model, cfg.block_size, dtype)
        if n < 2:
            raise ConfigError("kv_cache_bytes", f"{cfg.kv_cache_bytes} bytes hold fewer than 2 blocks")
        return int(n)
    # Enough for max_num_seqs sequences of max_model_len, capped at 2048 blocks (32K
    # tokens; 1.5 GB for SmolLM2 in fp32) so the default fits a laptop.
    per_seq = -(-cfg.max_model_len // cfg.block_size)
    return max(2, min(cfg.max_num_seqs * per_seq, 2048))


@dataclass(frozen=True)
class SharedKV:
    """A KV tensor allocated with `shared=True`, as another process maps it: its shape
    and dtype (this, pickled), and its memfd, passed beside over a Unix socket."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def send(sock_fd: int, memfd: int) -> None:
        """Pass `memfd` over the connected Unix socket `sock_fd`: one byte, the
        descriptor as ancillary data. Nothing else may be written to it meanwhile."""
        with socket.socket(fileno=os.dup(sock_fd)) as sock:
            socket.send_fds(sock, [b"k"], [memfd])

    def receive(self, sock_fd: int) -> torch.Tensor:
        """The descriptor `send` passed, read from `sock_fd` (nothing else may read it
        meanwhile), and its pages mapped here: writes on either side are seen by both."""
        with socket.socket(fileno=os.dup(sock_fd)) as sock:
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if len(fds) != 1:
            raise RuntimeError(f"expected the KV tensor's descriptor, got {len(fds)}")
        try:
            return _mapped(f"/proc/self/fd/{fds[0]}", self.shape, self.dtype)
        finally:
            os.close(fds[0])  # the mapping keeps the pages


def _mapped(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class KVCache:
    """Owns the KV tensor; hands out per-layer (K, V) views for attention."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 shared: bool = False):
        """`shared`: in shared memory that another process can map (`share`); CPU only."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)
        self._memfd: int | None = None
        if shared:
            if torch.device(device).type != "cpu":
                raise ConfigError("engine_process", f"a KV cache on {device} cannot be shared with the replica")
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            self._memfd = os.memfd_create("duet-kv", os.MFD_CLOEXEC)
            os.ftruncate(self._memfd, nbytes)
            self.data = _mapped(f"/proc/self/fd/{self._memfd}", shape, dtype)
            # Touch every page now, as torch.zeros does for a private tensor (0.4 s for
            # the default 1.5 GB pool): a page of shared memory is allocated and zeroed
            # at its first write, so a step writing into never-used blocks paid a fault
            # per page, until the pool's blocks had all been used once (1.7 ms to write
            # one 128-token prompt's KV into fresh pages against 0.09 ms into touched
            # ones; a prefill step 2-4 ms slower than with a private tensor).
            self.data.zero_()
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(model.num_layers)]
        self.bytes_per_block = self.data[0].numel() * self.data.element_size()

    def share(self) -> SharedKV | None:
        """How another process maps this tensor; None unless allocated `shared`."""
        if self._memfd is None:
            return None
        return SharedKV(tuple(self.data.shape), self.data.dtype)

    @property
    def memfd(self) -> int | None:
        """The shared-memory file the tensor lives in (`shared=True`), for `SharedKV.send`."""
        return self._memfd

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's KV, every layer: a forked sequence's
        own copy of the block it will write into (copy-on-write)."""
        for src, dst in copies:
            self.data[dst].copy_(self.data[src])
