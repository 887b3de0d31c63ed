"""What the vLLM suite's tests share (conftest.py holds only pytest's hooks and fixtures): the
engine environment's paths, the warm parent that forks each vLLM run (`ZYGOTE`) and `run_vllm`.
A module of its own name, so that tests import it by name beside the SGLang suite's conftest
in one pytest session (`make engine-test`)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvtier.bench.engine_env import engine_environ

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
MODEL = VENV / "models" / "smollm2-135m-instruct"
KV_CACHE_BYTES = 512 << 20  # 11K tokens of SmolLM2 in float32: any prompt here fits


class Zygote:
    """The test side of zygote.py: one warm parent per test session, forking a child per run (each
    run is still a process of its own; it skips about 15 s of imports). Started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-zygote-"))
        self.runs = 0

    def start(self) -> subprocess.Popen[str]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.log = open(self.dir / "zygote.err", "w")  # noqa: SIM115 (the zygote's own output, closed by close())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=engine_environ(VENV),
            cwd=REPO,
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        assert self._next(600) == {"ready": True}, (self.dir / "zygote.err").read_text()[-6000:]
        return self.proc

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ZYGOTE "):
                lines.put(line[len("ZYGOTE ") :])
        lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"the zygote died:\n{(self.dir / 'zygote.err').read_text()[-6000:]}")
        return dict(json.loads(line))

    def run(
        self, target: dict[str, str], argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Runs `target` ({"module": name} or {"path": file}) with `argv` in a fresh child, as
        subprocess.run would (TimeoutExpired after killing the child's whole process group)."""
        proc = self.start()
        assert proc.stdin is not None
        self.runs += 1
        out, err = self.dir / f"{self.runs}.out", self.dir / f"{self.runs}.err"
        request = {
            **target,
            "argv": argv,
            "env": env,
            "cpus": sorted(os.sched_getaffinity(0)),
            "cwd": str(REPO),
            "stdout": str(out),
            "stderr": str(err),
        }
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        pid = self._next(60)["pid"]
        try:
            done = self._next(timeout)
        except queue.Empty:
            os.killpg(pid, signal.SIGKILL)
            self._next(60)
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
        assert done["pid"] == pid, done
        return subprocess.CompletedProcess(argv, done["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(60)
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


ZYGOTE = Zygote()


def run_vllm(
    spec: dict[str, Any], expect_ok: bool = True, timeout: int = 600, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """One vLLM process; returns its RESULT (or, when it must fail, its exit code and output)."""
    spec = {"model": str(MODEL), **spec}
    if "gpu_memory_utilization" not in spec:  # vLLM's KV cache: 512 MiB, not 30% of RAM (4 s less a run)
        spec["engine"] = {"kv_cache_memory_bytes": KV_CACHE_BYTES, **spec.get("engine", {})}
    target = {"module": "kvtier.integrations.vllm.run"}
    proc = ZYGOTE.run(target, [json.dumps(spec)], engine_environ(VENV, env_extra), timeout)
    if not expect_ok:
        return {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return dict(json.loads(lines[-1][len("RESULT ") :]))
