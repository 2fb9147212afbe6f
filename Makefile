# The README's two commands: `make demo` (serve + a short load test) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export PYTHONHASHSEED := 0

.PHONY: setup demo test test-unit test-integration lint bench image image-test

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: $(VENV)/.installed

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/test.sh

lint: setup
	bash scripts/lint.sh

# The pure-logic unit tests, under a minute; `-m model` the unit tests that run the model.
test-unit: setup
	$(PY) -m pytest -m "unit and not model" -q -n 2 tests/unit

bench: setup
	$(VENV)/bin/duet bench engine --json out/bench_engine.json

# The image the Helm chart runs (deploy/Containerfile); TORCH_VARIANT=cuda for the GPU one.
image:
	bash scripts/image.sh

# Boots it here (root): `duet serve` from its file system, and three namespace nodes.
image-test: setup image
	$(PY) -m pytest -m image -q -p no:cacheprovider tests/image
