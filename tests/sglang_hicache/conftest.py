"""The SGLang suite runs in the engine environment (`make vllm-env` installs the pinned sglang
wheel into .venv-vllm) with `make sglang-test`; `make test` runs it. Aimed at this directory from
an environment without sglang it fails, never skips: an engine test that silently skips in CI does
not exist. A run of the whole `tests/` tree elsewhere (`make py-test` in .venv) leaves it out."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.redis import LocalRedis

HERE = Path(__file__).resolve().parent


def _aimed_here(config: pytest.Config) -> bool:
    root = Path(config.invocation_params.dir)
    for arg in config.args:
        path = (root / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def _missing() -> str | None:
    # a namespace package of that name (no origin) is not the real one:
    # only a regular package (with an origin) is the real one.
    spec = importlib.util.find_spec("sglang")
    return None if spec is not None and spec.origin is not None else "sglang is not installed here"


# Read by pytest for the files of this directory; set by pytest_configure below.
collect_ignore_glob: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    reason = _missing()
    if reason is None:
        return
    if _aimed_here(config):
        raise pytest.UsageError(
            f"the SGLang suite needs the engine environment; run `make sglang-test` (it builds .venv-vllm): {reason}"
        )
    collect_ignore_glob.append("*.py")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server
