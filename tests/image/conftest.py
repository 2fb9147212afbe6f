"""The built image (deploy/Containerfile, `make image`) mounted as a root file system
the tests run its programs from with `chroot`: its own Python, Ray and duet.

No container runtime is needed (none can run here): buildah makes a working container
of the image and mounts it; /proc, /sys and /dev are mounted inside, and the host's
/etc/hosts and resolv.conf copied in, as a runtime would. The working container is
removed afterwards, so the image itself is never changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "multinode"))  # the namespace cluster's helpers


def image_ref() -> str:
    version = subprocess.run([sys.executable, str(REPO / "scripts" / "pins.py"), "version"], capture_output=True,
                             text=True, check=True).stdout.strip()
    return os.environ.get("DUET_IMAGE", f"localhost/duet:{version}")


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout.strip()


@pytest.fixture(scope="session")
def image_root() -> Iterator[Path]:
    if shutil.which("buildah") is None:
        pytest.fail("buildah is not installed: `make image` installs it and builds the image")
    ref = image_ref()
    if subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True).returncode != 0:
        pytest.fail(f"no image {ref}: build it with `make image`")
    ctr = _run("buildah", "from", "--pull=never", ref)
    mounted: list[Path] = []
    try:
        root = Path(_run("buildah", "mount", ctr))
        for fs, target, opts in (("proc", "proc", ["-t", "proc"]), ("sysfs", "sys", ["-t", "sysfs"]),
                                 ("/dev", "dev", ["--rbind"])):
            _run("mount", *opts, fs, str(root / target))
            mounted.append(root / target)
        for f in ("etc/hosts", "etc/resolv.conf"):
            shutil.copyfile(f"/{f}", root / f)
        yield root
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", "--recursive", "--lazy", str(m)], capture_output=True)
        subprocess.run(["buildah", "umount", ctr], capture_output=True)
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
