# Quick start: `make demo` runs the main job, `make test` runs the test suite. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-slow flops speed evidence clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch torchvision
	$(VENV)/bin/pip install -q --disable-pip-version-check -e ".[test,faiss]"
	touch $@

# The main job: synthetic long videos -> 2-process CPU training -> retrieval with/without aggregation (< 10 min).
demo: install
	$(PY) train/demo.py --output-dir outputs/demo

test: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

flops: install
	$(PY) benchmarks/flops.py

speed: install
	$(PY) benchmarks/encoder_speed.py

# Regenerates the README's tables and pictures on CPU (about 45 minutes on 2 cores; parity_with_released.py needs
# a checkout of the released code and is run by hand, see README).
evidence: install
	$(VENV)/bin/pip install -q --disable-pip-version-check matplotlib
	test -f outputs/demo/train/final/model.safetensors || $(PY) train/demo.py --output-dir outputs/demo
	$(PY) benchmarks/flops.py
	$(PY) benchmarks/rerank_cost.py
	$(PY) benchmarks/encoder_speed.py
	$(PY) benchmarks/decode_speed.py --runs 9
	$(PY) benchmarks/ablations.py --model outputs/demo/train/final --data outputs/demo/data --output docs/ablations
	$(PY) benchmarks/tradeoff.py --model outputs/demo/train/final --data outputs/demo/data --output docs/tradeoff
	$(PY) benchmarks/make_visualization.py
	$(PY) benchmarks/make_grounding.py --model outputs/demo/train/final --data outputs/demo/data
	$(PY) benchmarks/evaluation_equivalence.py --model outputs/demo/train/final --data outputs/demo/data
	$(PY) benchmarks/eval_memory.py
	$(PY) benchmarks/transformers_encoders.py
	$(PY) benchmarks/training_free.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
