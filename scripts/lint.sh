#!/usr/bin/env bash
# Lint (ruff: pycodestyle, pyflakes, import order, bugbear, pyupgrade) and type-check
# (mypy over the typed rooms); both configured in pyproject.toml. `make test` runs it
# first, so CI fails on a new violation.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUET_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"
