# paradraft: two commands on a fresh machine.
#   make demo   set everything up, then run the main job on the embedded verifier
#   make test   set everything up, then run the test suite
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.paradraft-installed
# torch is pinned HERE (the CPU wheel lies on this machine's disk); the package itself asks for a range.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-slow bench clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf runs build src/*.egg-info
