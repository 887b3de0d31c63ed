"""A warm parent for the vLLM suite's engine processes: it imports vLLM, torch and kvtier's connector
once (about 15 s of CPU per process on this machine), then forks one child per run. Each child is
a process of its own, as a user's vLLM is (its DRAM tier dies with it); it only skips the imports.
vLLM's own engine-core and TP worker processes are spawned by the child as they always are.

Protocol (the test side is `vllm_harness.Zygote`): one JSON request per line on stdin, `{"argv": [...],
"module": name | "path": file, "env": {...}, "cpus": [...], "cwd": dir, "stdout": file, "stderr":
file}`; the zygote answers on stdout `ZYGOTE {"pid": n}` when the child starts and `ZYGOTE {"pid":
n, "returncode": r}` when it has exited (a negative code: killed by that signal). The child takes
the test's CPUs, the request's environment on top of the one the imports left (vLLM's import sets
variables of its own), leads its own process group (the test kills the whole group on a timeout),
and runs the module or file as `__main__`, as `python -m` or `python file` would, so that
processes vLLM spawns re-import it the same way. How it exits: `become`.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
from typing import Any

PREFIX = "ZYGOTE "


def answer(msg: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(msg) + "\n")
    sys.stdout.flush()


def serve() -> dict[str, Any] | None:
    """Forks a child per request; returns in the child only (with its request), or None at EOF."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return dict(request)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
    return None


def become(request: dict[str, Any]) -> None:
    """The child: the request's CPUs, process group, files, environment, directory and program."""
    # A child of the warm parent starts pinned to one CPU (Intel OpenMP's fork handler, as the
    # parent has run OpenMP code): a process started by the test would have the test's CPUs.
    os.sched_setaffinity(0, request["cpus"])
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"] if "module" in request else os.path.dirname(os.path.abspath(request["path"]))
    sys.argv = ["zygote-child", *request["argv"]]
    if "module" in request:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["path"], run_name="__main__")
    # Done without an error: Python's own shutdown, but for the teardown of every module's objects
    # (4-5 s of garbage collection over torch, transformers and vLLM). Threads are joined and
    # atexit handlers run (vLLM's engine shutdown among them) as at any exit; nothing of kvtier's
    # relies on finalizers (the run closes its workers itself). A failed program exits fully.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def warm() -> None:
    """What every run imports: vLLM's engine, torch, and kvtier's connector. Not the run driver
    itself: `runpy` runs it as `__main__`, and a copy already imported would be a second one."""
    import torch  # noqa: F401

    import kvtier.integrations.vllm.connector
    import kvtier.integrations.vllm.worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401


if __name__ == "__main__":
    warm()
    answer({"ready": True})
    child = serve()
    if child is not None:
        become(child)
