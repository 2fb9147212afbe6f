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
from the GGUF; 4 bytes a parameter: 0.5 GiB for the embedded model, 5.5x its 4-bit
GGUF). Writing an entry removes the same model's entries of other keys that nobody
wrote for an hour. The key hashes the GGUF's resolved path, size and
modification time, the source of the modules that convert (engine/weights.py,
engine/tokenizer.py, this one) and the versions of the libraries they use: an edited
file, a changed conversion or an upgraded library misses instead of reading stale
weights.

Each part is written and fsynced in a temporary directory beside its final place and
renamed into it, so concurrent first starts each convert, one rename wins, and nobody
reads a half-written part. The cache never stops a start: a part that cannot be
written only costs the conversion, and one that cannot be read is removed and
converted again (`load_or_convert`). The directory is
``$DUET_MODEL_CACHE``, else ``~/.cache/duet/models``; ``DUET_MODEL_CACHE=off``
disables the cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# Bump when the layout of what is written changes.
FORMAT = 1
CACHE_ENV = "DUET_MODEL_CACHE"
# The modules whose code decides what is written, and the libraries they call.
_CONVERTERS = ("weights.py", "tokenizer.py", "model_cache.py")
_LIBRARIES = ("gguf", "transformers", "tokenizers", "safetensors", "numpy", "torch")
# A temporary part older than this was left by a start that died while writing.
_ABANDONED_S = 3600.0


def cache_root() -> Path | None:
    """Where converted checkpoints live; None when the cache is off."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() in ("off", "0", "false", "none"):
        return None
    return Path(value).expanduser().resolve() if value else Path.home() / ".cache" / "duet" / "models"


@functools.cache
def _converter_fingerprint() -> str:
    h = hashlib.sha256(f"format {FORMAT}".encode())
    here = Path(__file__).parent
    for name in _CONVERTERS:
        h.update((here / name).read_bytes())
    for lib in _LIBRARIES:
        try:
            h.update(f"{lib} {importlib.metadata.version(lib)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{lib} -".encode())
    return h.hexdigest()


def entry_dir(gguf_path: Path, model_id: str) -> Path | None:
    """The directory of `gguf_path`'s converted copy (which may not exist yet)."""
    root = cache_root()
    if root is None:
        return None
    resolved = gguf_path.resolve()
    st = resolved.stat()
    source = f"{_converter_fingerprint()}\0{resolved}\0{st.st_size}\0{st.st_mtime_ns}"
    return root / f"{model_id}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def cached_part(gguf_path: Path, model_id: str, part: str) -> Path | None:
    """`part` ("weights", "tokenizer") of the converted copy, if it was written and
    can be reached (a cache this process may not read is no cache)."""
    try:
        entry = entry_dir(gguf_path, model_id)
        if entry is None:
            return None
        path = entry / part
        return path if path.is_dir() else None
    except Exception as exc:  # no home directory, a root this user may not traverse
        log.warning("model cache: cannot look up %s (%s); converting", part, exc)
        return None


def store_part(gguf_path: Path, model_id: str, part: str, write: Callable[[Path], object]) -> Path | None:
    """Write `part` with `write(directory)` and move it into place; the part's path,
    or None when the cache is off or the part could not be written (logged)."""
    final: Path | None = None
    tmp: Path | None = None
    try:
        entry = entry_dir(gguf_path, model_id)
        if entry is None:
            return None
        final = entry / part
        entry.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(entry)
        _remove_superseded(entry, model_id)
        tmp = Path(tempfile.mkdtemp(prefix=f".{part}-", dir=entry))
        write(tmp)
        _fsync_tree(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of the cache
        os.rename(tmp, final)  # atomic; fails if another process got there first
        tmp = None
        _fsync_dir(entry)
        log.info("model cache: wrote %s", final)
    except Exception as exc:  # a full disk, a read-only home, a writer that failed
        if final is None or not _is_dir(final):
            log.warning("model cache: could not write %s (%s); the next start converts again", final or part, exc)
            return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_or_convert(
    gguf_path: Path, model_id: str, part: str, read: Callable[[Path], T], convert: Callable[[], T],
    write: Callable[[T, Path], object],
) -> T:
    """`read(path)` of the cached `part`; on a miss, or a part `read` fails on (then
    removed), `convert()` and store the result with `write(result, directory)`."""
    path = cached_part(gguf_path, model_id, part)
    if path is not None:
        try:
            return read(path)
        except Exception as exc:  # truncated by a crash, written by another layout
            discard_part(path, exc)
    value = convert()
    store_part(gguf_path, model_id, part, lambda d: write(value, d))
    return value


def discard_part(path: Path, exc: Exception) -> None:
    """Remove a part that could not be read, so the next start writes it again."""
    log.warning("model cache: %s is unreadable (%s); converting again", path, exc)
    trash = path.with_name(f".{path.name}-unreadable-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)  # atomic: no reader sees it half-removed
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _remove_superseded(entry: Path, model_id: str) -> None:
    """Remove this model's entries of other keys (an older conversion, library or
    file) untouched for an hour: each is ~4 bytes a parameter."""
    name = re.compile(rf"{re.escape(model_id)}-[0-9a-f]{{16}}")
    now = time.time()
    for p in entry.parent.iterdir():
        try:
            if p != entry and name.fullmatch(p.name) and now - p.stat().st_mtime > _ABANDONED_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _remove_abandoned(entry: Path) -> None:
    now = time.time()
    for p in entry.glob(".*-*"):
        try:
            if now - p.stat().st_mtime > _ABANDONED_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _fsync_tree(directory: Path) -> None:
    """Everything written under `directory` on disk before the rename publishes it."""
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
