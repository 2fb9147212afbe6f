"""C++ kernels for the CPU path, compiled once per machine on first use.

torch's JIT extension loader builds `engine/csrc/*.cpp` with `-march=native` into
its cache (`~/.cache/torch_extensions`, or `$TORCH_EXTENSIONS_DIR`). The module's
name carries a hash of the source, the compiler flags and the CPU's flags, so a
cached build never runs on a CPU it was not built for (these machines' CPUs change
between sessions). A cold build takes 11-15 s on 2 cores; `scripts/setup.sh` runs it
ahead of time so that no replica pays it while serving.

Where the build cannot happen (no C++ compiler, or it fails) the caller falls back
to the torch path; the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import ConfigError, cpu_flags

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -ffast-math on the compile step only lets GCC vectorise the softmax's exp and the
# dot products' reductions; without it on the link step no FTZ/DAZ start-up code is
# linked in, so the process's floating-point mode is left as it was.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_LDFLAGS = ["-fopenmp"]


def _module_name() -> str:
    h = hashlib.sha256()
    h.update(_SOURCE.read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(" ".join(cpu_flags()).encode())
    h.update(torch.__version__.encode())
    return f"duet_paged_decode_{h.hexdigest()[:16]}"


@functools.cache
def load_paged_decode() -> Callable | None:
    """The compiled `paged_decode_attention` op, or None (logged) where it cannot be built."""
    from torch.utils.cpp_extension import load

    # The `ninja` the project installs lives beside this interpreter, which is not on
    # PATH in a Ray worker or an unactivated venv; torch's loader looks on PATH.
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        load(
            name=_module_name(),
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            verbose=bool(os.environ.get("DUET_KERNEL_BUILD_VERBOSE")),
            is_python_module=False,  # the library registers torch.ops.duet.*
        )
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        log.warning("native paged decode attention unavailable, using the torch path: %s", e)
        return None
    return torch.ops.duet.paged_decode_attention


def select_decode_kernel(choice: str, device: str) -> Callable | None:
    """The decode attention op for `engine.decode_attention` on `device`; None means
    the torch path. "native" is an error where the kernel cannot run."""
    if choice == "torch":
        return None
    if device != "cpu":
        if choice == "native":
            raise ConfigError("decode_attention", f"the native kernel runs on the CPU only, not {device}")
        return None
    kernel = load_paged_decode()
    if kernel is None and choice == "native":
        raise ConfigError("decode_attention", "the native kernel could not be built here (see the log); "
                          "use auto or torch")
    return kernel


if __name__ == "__main__":  # `python -m engine.cpu_kernels`: build (or find) the kernels now
    import time

    t0 = time.perf_counter()
    ok = load_paged_decode() is not None
    print(f"paged decode attention: {'ready' if ok else 'unavailable'} in {time.perf_counter() - t0:.1f} s")
    raise SystemExit(0 if ok else 1)
