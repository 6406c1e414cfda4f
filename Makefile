# Quick start: `make demo` runs the main job, `make test` runs the test suite. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-slow app flops speed evidence clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch torchvision
	$(VENV)/bin/pip install -q --disable-pip-version-check -e ".[test,faiss,milvus,st,mteb,app,openvino,onnxruntime]"
	touch $@

# The main job: the short-event task -> (a) 8 frames and (b) 16 frames + TESTA at the GMAC of (a), trained on CPU ->
# retrieval table, then a small VideoQA head from (b) for the QA pipeline (outputs/demo/qa/final; `--no-qa` skips it)
# (`python train/demo.py --upper-bound` adds (c) 16 frames; `--quick`: a smoke run).
demo: install
	$(PY) train/demo.py --output-dir outputs/demo

test: install
	$(PY) tests/helpers/transformers_common.py  # transformers' own common test mixins, from its sdist (pip)
	$(PY) -m pytest -q -m "not slow"

# The Gradio app on the demo's model (b) over the demo's test videos, at http://127.0.0.1:7860 (ranking by cosine, as
# the demo evaluates: its short training leaves the matching head too weak to re-rank; the page can switch it on),
# asking the demo's QA head; on your own machine, so the Model tab may change R_T/R_S (--allow-settings) and the page
# may index any folder and inspect any video file (--allow-folders)
app: install
	@test -f outputs/demo/runs/b/final/model.safetensors || { echo "No demo model: run \`make demo\` first, or: python app/app.py --model FOLDER_OR_HUB_ID --videos DIR"; exit 1; }
	$(PY) app/app.py --model outputs/demo/runs/b/final --videos outputs/demo/data/videos --no-rerank --allow-settings \
	  --allow-folders \
	  $$(test -f outputs/demo/qa/final/model.safetensors && echo --qa-model outputs/demo/qa/final)  # the demo ranks by cosine (see configuration/short_events.yaml)

test-slow: install
	$(PY) -m pytest -q -m slow

flops: install
	$(PY) -m benchmarks.flops

speed: install
	$(PY) -m benchmarks.encoder_speed

# Regenerates the tables and pictures of docs/ on CPU (over an hour on 2 cores; parity_with_released needs a
# checkout of the released code and is run by hand, see docs/parity.md).
evidence: install
	$(VENV)/bin/pip install -q --disable-pip-version-check matplotlib
	test -f outputs/synthetic/train/final/model.safetensors || ( \
	  $(PY) -m processing.synthetic --output-dir outputs/synthetic/data --num-videos 640 && \
	  OMP_NUM_THREADS=1 $(PY) -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 \
	    --mixed_precision no --dynamo_backend no train/finetune_retrieval.py \
	    --config configuration/synthetic_retrieval.yaml --dataset outputs/synthetic/data \
	    --output-dir outputs/synthetic/train --no-eval )
	$(PY) -m benchmarks.frames_vs_compute --seeds 3
	$(PY) -m benchmarks.flops
	$(PY) -m benchmarks.rerank_cost
	$(PY) -m benchmarks.encoder_speed
	$(PY) -m benchmarks.decode_speed --runs 9
	$(PY) -m benchmarks.ablations --model outputs/synthetic/train/final --data outputs/synthetic/data --output docs/ablations
	$(PY) -m benchmarks.tradeoff --model outputs/synthetic/train/final --data outputs/synthetic/data --output docs/tradeoff
	$(PY) -m benchmarks.make_visualization
	$(PY) -m benchmarks.make_grounding --model outputs/synthetic/train/final --data outputs/synthetic/data
	$(PY) -m benchmarks.evaluation_equivalence --model outputs/synthetic/train/final --data outputs/synthetic/data
	$(PY) -m benchmarks.eval_memory
	$(PY) -m benchmarks.transformers_encoders
	$(PY) -m benchmarks.training_free
	$(PY) -m benchmarks.gemm_backends
	$(PY) -m benchmarks.pyav_conversion
	$(PY) -m benchmarks.memory_96 --threads 1
	$(PY) -m benchmarks.memory_96 --train --no-int8 --no-blocks  # about 16 GB of RAM and 10 minutes
	test -f outputs/demo/runs/b/final/model.safetensors || $(PY) train/demo.py --output-dir outputs/demo
	$(PY) -m benchmarks.fast_inference --no-speed --model outputs/demo/runs/b/final --data outputs/demo/data \
	  --config configuration/short_events.yaml --text --noise-draws 4 --json docs/quality_contract_demo_b.json
	$(PY) -m benchmarks.fast_inference --no-speed --model outputs/demo/runs/a/final --data outputs/demo/data \
	  --config configuration/short_events.yaml --noise-draws 4 --json docs/quality_contract_demo_a.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
