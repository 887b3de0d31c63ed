"""scripts/vllm_env.py, the engine environment's builder: a failing step exits naming the step, its exit
code and the free disk space (the environment takes about 7 GB; a full disk fails pip with no line
that says so). The build itself runs in `make vllm-env` (CI builds it before the engine suites)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_env.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_env_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_step_exits_naming_the_step_its_code_and_the_free_space() -> None:
    script = load_script()
    with pytest.raises(SystemExit) as exited:
        script.run("requirements", [sys.executable, "-c", "raise SystemExit(3)"])
    said = str(exited.value.code)
    assert re.fullmatch(
        r"\[vllm-env\] step 'requirements' failed with exit code 3 \(\d+\.\d GiB free on .+\)", said
    ), said


def test_a_step_that_succeeds_returns() -> None:
    load_script().run("ok", [sys.executable, "-c", "pass"])
