"""Mooncake for the benchmarks that compare against it (``bench peers``, ``bench sglang``):
installing its store into an environment and running its master on loopback.

Mooncake's store ships as ``mooncake-transfer-engine-non-cuda`` (pinned here); its library links
``libibverbs.so.1`` even for TCP, so the Debian package ``libibverbs1`` is installed when missing.
A step that fails is reported as the reason Mooncake cannot run here, never as a figure.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

from kvtier.errors import KvtierError

MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
_IMPORT = "from mooncake.store import MooncakeDistributedStore"


def say(show: bool, who: str, text: str) -> None:
    if show:
        print(f"bench {who}: {text}", file=sys.stderr, flush=True)


def step(name: str, cmd: list[str], show: bool, who: str = "peers") -> None:
    """Runs one environment step; a failure raises with the step's name and the end of its output."""
    say(show, who, f"venv: {name}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise KvtierError(
            f"bench {who}: step '{name}' failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}"
        )


def install_mooncake(python: Path, show: bool, who: str = "peers") -> str | None:
    """Installs Mooncake's store into the interpreter's environment (a no-op when it imports
    already); the reason it cannot run here, or None."""
    if subprocess.run([str(python), "-c", _IMPORT], capture_output=True).returncode == 0:
        return None
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    try:
        if "libibverbs.so.1" not in ldconfig:
            if shutil.which("apt-get") is None:
                return "libibverbs1 is missing and there is no apt-get to install it"
            step(
                "install libibverbs1 (apt) for mooncake",
                ["apt-get", "install", "-y", "libibverbs1"],
                show,
                who,
            )
        step(f"install {MOONCAKE}", [str(python), "-m", "pip", "install", MOONCAKE], show, who)
        step("import mooncake's store", [str(python), "-c", _IMPORT], show, who)
    except KvtierError as e:
        return str(e)
    return None


class MooncakeServers(TypedDict):
    """Where a :func:`mooncake_master` listens (JSON: it travels to worker processes)."""

    metadata: str  # the HTTP metadata server's URL
    master: str  # the master's RPC host:port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def mooncake_master(venv: Path, workdir: Path) -> Iterator[MooncakeServers]:
    """``mooncake_master`` with its HTTP metadata server on loopback, for as long as the block
    runs; yields where its servers listen. Its log is ``workdir/master.log``."""
    http, rpc = free_port(), free_port()
    spec: MooncakeServers = {"metadata": f"http://127.0.0.1:{http}/metadata", "master": f"127.0.0.1:{rpc}"}
    cmd = [
        str(venv / "bin" / "mooncake_master"), "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={http}", f"--rpc_port={rpc}",
    ]  # fmt: skip
    log_path = workdir / "master.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (_listening(rpc) and _listening(http)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise KvtierError(f"mooncake_master did not start: {log_path.read_text()[-1500:]}")
            time.sleep(0.1)
        yield spec
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ends a server this bench started (by its pid only): SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
