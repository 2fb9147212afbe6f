"""A converted copy of each GGUF checkpoint, so a replica starts from plain files.

Parsing the embedded GGUF costs ~5 s of CPU each time (gguf's reader builds a numpy
view per vocabulary string and per merge: ~98k of them), and every replica parsed it
twice: once for the tokenizer, once for the weights. That was most of a replica's start
on these 2-core machines, and a replica's start is what an autoscaler waits for.

The first process to parse a GGUF writes what it parsed under the cache directory:

    <cache>/<model id>-<key>/weights/   config.json (a `ModelConfig`) + model.safetensors
    <cache>/<model id>-<key>/tokenizer/ the Hugging Face tokenizer files

Later starts read those: the tokenizer from its JSON (~0.2 s), the weights from
safetensors (dequantized already, float32, so any dtype converts from them exactly as
from the GGUF). The key hashes the GGUF's resolved path, size and modification time
and `FORMAT`: an edited file or a changed conversion misses instead of reading stale
weights.

Each part is written to a temporary directory beside its final place and renamed into
it, so concurrent first starts each convert, one rename wins, and nobody reads a
half-written part. The directory is ``$DUET_MODEL_CACHE``, else
``~/.cache/duet/models``; ``DUET_MODEL_CACHE=off`` disables the cache, and an
unwritable directory only costs the conversion (logged once per part).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# Bump when what is written (or how it is converted) changes.
FORMAT = 1
CACHE_ENV = "DUET_MODEL_CACHE"


def cache_root() -> Path | None:
    """Where converted checkpoints live; None when the cache is off."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() in ("off", "0", "false", "none"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "duet" / "models"


def entry_dir(gguf_path: Path, model_id: str) -> Path | None:
    """The directory of `gguf_path`'s converted copy (which may not exist yet)."""
    root = cache_root()
    if root is None:
        return None
    resolved = gguf_path.resolve()
    st = resolved.stat()
    key = hashlib.sha256(f"{FORMAT}\0{resolved}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / f"{model_id}-{key}"


def cached_part(gguf_path: Path, model_id: str, part: str) -> Path | None:
    """`part` ("weights", "tokenizer") of the converted copy, if it was written."""
    entry = entry_dir(gguf_path, model_id)
    if entry is None:
        return None
    path = entry / part
    return path if path.is_dir() else None


def store_part(gguf_path: Path, model_id: str, part: str, write: Callable[[Path], object]) -> Path | None:
    """Write `part` with `write(directory)` and move it into place; the part's path,
    or None when the cache is off or could not be written."""
    entry = entry_dir(gguf_path, model_id)
    if entry is None:
        return None
    final = entry / part
    tmp: Path | None = None
    try:
        entry.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{part}-", dir=entry))
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of the cache
        os.rename(tmp, final)  # atomic; fails if another process got there first
        tmp = None
        log.info("model cache: wrote %s", final)
    except OSError as exc:
        if not final.is_dir():
            log.warning("model cache: could not write %s (%s); the next start converts again", final, exc)
            return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
