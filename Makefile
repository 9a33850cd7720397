# Two entry points: `make demo` (set up + main job) and `make test` (set up + full test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CACHE ?= .cache/eva0-edge
STAMP := $(VENV)/.eva0-edge-installed

.PHONY: setup demo test test-fast lint

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]"
	touch $@

setup: $(STAMP)

demo: setup
	mkdir -p $(CACHE)
	$(VENV)/bin/eva0-edge export --arch vit_tiny_patch16_224 --set img_size=32 --set patch_size=4 \
		--set num_classes=10 -o $(CACHE)/vit_tiny_32.onnx
	$(VENV)/bin/eva0-edge info $(CACHE)/vit_tiny_32.onnx

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
