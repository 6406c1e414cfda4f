# Quick start: `make demo` runs the main job, `make test` runs the test suite. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-slow flops speed benchmarks clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch torchvision
	$(VENV)/bin/pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

demo: install
	$(PY) benchmarks/flops.py
	$(PY) benchmarks/encoder_speed.py --small

test: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

flops: install
	$(PY) benchmarks/flops.py

speed: install
	$(PY) benchmarks/encoder_speed.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
