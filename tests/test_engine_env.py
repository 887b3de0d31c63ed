"""``kvtier.bench.engine_env.run_worker``: a worker's ``RESULT`` line read back as a JSON object, with
a real worker process (this interpreter standing in for an engine environment's)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvtier.bench.engine_env import run_worker
from kvtier.errors import KvtierError


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An "environment" whose python is this one, with a worker module that prints its argument."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "echo_worker.py").write_text(
        "import sys\nprint('log line')\nprint('RESULT ' + sys.argv[1])\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_a_workers_result_object_is_returned(venv: Path) -> None:
    assert run_worker(venv, "echo_worker", ['{"a": [1, 2]}'], "echo", 60) == {"a": [1, 2]}


@pytest.mark.parametrize(
    ("printed", "message"),
    [
        ("[1, 2]", r"echo: its RESULT is \[1, 2\]; expected a JSON object"),
        ("{", "echo: its RESULT is not JSON"),
    ],
)
def test_a_result_that_is_no_json_object_is_an_error(venv: Path, printed: str, message: str) -> None:
    with pytest.raises(KvtierError, match=message):
        run_worker(venv, "echo_worker", [printed], "echo", 60)
