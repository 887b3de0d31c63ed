"""``kvtier bench peers``: kvtier against LMCache and Mooncake on the same bytes, in one run.

The peers live in their own environment (``--venv``, default ``.venv-peers``), created here once
and stamped (:func:`ensure_venv`): LMCache 0.5.6 installed without its heavy dependencies (its
CPU path, ``LMCacheEngine`` -> ``LocalCPUBackend``), torch from PyPI (run on the CPU), and
Mooncake's store over TCP (``mooncake-transfer-engine-non-cuda``, which needs ``libibverbs1``).
A peer that cannot run here is reported with the reason, never with a figure.

Each round runs, part by part, a kvtier process and a peer process one after the other (the
order alternates between rounds), each on the same bytes (the round's seed), each timing a
plain memcpy of those bytes itself (:mod:`kvtier.bench.peers_worker`). Per row and round:
each side ÷ memcpy (its bandwidth as a share of the copy's), and kvtier's speed ÷ the peer's
(above 1: kvtier faster); the table gives the median and range over the rounds, and the 1-minute
load average after each part (the bench keeps about one core busy itself). ``--parts`` picks the
parts; the ``ssd`` part (``--ssd-bytes`` per round, written under ``--ssd-dir``) compares kvtier's
SSD tier with LMCache's ``LocalDiskBackend`` (:mod:`kvtier.bench.peers_ssd` says how).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict

from kvtier.bench import kv_fixture
from kvtier.bench.mooncake_env import MOONCAKE, install_mooncake, mooncake_master, say, step, stop
from kvtier.bench.peers_protocol import Spec, WorkerResult
from kvtier.bench.peers_ssd import filesystem_of
from kvtier.bench.peers_table import NOT_MEASURED, PARTS, PartRound, PeersResult, Round, aggregate, summary
from kvtier.errors import KvtierError
from kvtier.results import field_of, json_text

LMCACHE = "lmcache==0.5.6"
TORCH = ("torch==2.13.0", "numpy<=2.2.6")  # PyPI's torch (a CUDA build) runs on the CPU
#: What LMCache 0.5.6 imports on its CPU path (found by importing it), not its full Requires-Dist
#: (cupy, cuda-python, cufile, grpc, gcloud, ...).
LMCACHE_LIGHT = (
    "sortedcontainers", "msgspec", "pyzmq", "aiofile", "aiofiles", "blake3", "numba", "nvtx", "psutil",
    "py-cpuinfo", "pyyaml", "prometheus_client<=0.24.1", "opentelemetry-api<=1.40.0",
    "opentelemetry-sdk<=1.40.0", "redis", "safetensors", "cachetools", "aiohttp", "requests",
    "transformers>=5.4", "cryptography",
)  # fmt: skip
STAMP = "kvtier-peers.json"
WORKER = Path(__file__).with_name("peers_worker.py")
PEER_ENV = {
    "PYTHONHASHSEED": "0",
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_LOG_LEVEL": "WARNING",
}
LOOKUP_TOKENS = 131072


def rounds_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 5:
        raise argparse.ArgumentTypeError(f"{value} rounds; expected at least 5 (a median and a range)")
    return value


def parts_arg(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {', '.join(PARTS)}")
    return names


def add_command(bench_sub: Any, positive: Callable[[str], int], emit: Callable[..., None]) -> None:
    """`kvtier bench peers` (called where the CLI registers its bench subcommands)."""
    from kvtier.config import parse_size

    cmd = bench_sub.add_parser(
        "peers", help="kvtier vs LMCache (CPU) and Mooncake (TCP), alternating round by round, same bytes"
    )
    cmd.add_argument("--rounds", type=rounds_arg, default=5, help="rounds, at least 5 (default 5)")
    cmd.add_argument("--bytes", default="1GiB", help="bytes of Llama-3-8B bf16 KV per round (default 1GiB)")
    cmd.add_argument("--venv", default=".venv-peers", help="the peers' environment (created when missing)")
    cmd.add_argument(
        "--threads", type=int, default=0, help="kvtier's copy threads (0 = one per core, its default)"
    )
    cmd.add_argument(
        "--parts",
        type=parts_arg,
        default=tuple(PARTS),
        help=f"which parts to run (default all: {','.join(PARTS)})",
    )
    cmd.add_argument("--ssd-bytes", default="512MiB", help="bytes per round of the ssd rows (default 512MiB)")
    cmd.add_argument(
        "--ssd-dir", default=None, help="where the ssd rows write (default: the system temp dir)"
    )
    cmd.add_argument(
        "--ssd-codec",
        default="raw",
        choices=("raw", "lossless"),
        help="kvtier's ssd.codec in the ssd rows (default raw; lossless: byte planes + zstd)",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")

    def main(args: argparse.Namespace) -> None:
        sizes = {
            flag: (text, parse_size(text, flag))
            for flag, text in (("--bytes", args.bytes), ("--ssd-bytes", args.ssd_bytes))
        }
        for flag, (text, size) in sizes.items():
            if size < 32 * 2**20:
                raise KvtierError(f"{flag} is {text}; expected at least 32MiB (one LMCache chunk)")
        if args.ssd_dir is not None and not (
            os.path.isdir(args.ssd_dir) and os.access(args.ssd_dir, os.W_OK)
        ):
            raise KvtierError(f"--ssd-dir {args.ssd_dir!r}: expected an existing, writable directory")
        result = run(
            Path(args.venv), args.rounds, sizes["--bytes"][1], args.threads, show=not args.json,
            parts=args.parts, ssd_bytes=sizes["--ssd-bytes"][1], ssd_dir=args.ssd_dir,
            ssd_codec=args.ssd_codec,
        )  # fmt: skip
        emit(result, args.json, summary)

    cmd.set_defaults(func=main)


# ---------------------------------------------------------------- the peers' environment
def _say(show: bool, text: str) -> None:
    say(show, "peers", text)


class Stamp(TypedDict):
    """The peers' environment's stamp (``venv/kvtier-peers.json``): the pins it was made from,
    the versions installed (None: not installed), and why Mooncake cannot run (None: it can)."""

    spec: dict[str, object]
    versions: dict[str, str | None]
    mooncake_unavailable: str | None


def _read_stamp(path: Path, spec: Mapping[str, object]) -> Stamp | None:
    """The stamp at ``path`` when it was made from ``spec`` (else None: redo the environment)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("spec") != spec:
        return None
    where = str(path)
    versions = field_of(data, "versions", dict, where)
    bad = [k for k, v in versions.items() if not isinstance(v, str | None)]
    if bad:
        raise KvtierError(f"{where}: `versions.{bad[0]}` is {versions[bad[0]]!r}; expected a string or null")
    mooncake = data.get("mooncake_unavailable")
    if mooncake is not None and not isinstance(mooncake, str):
        raise KvtierError(f"{where}: `mooncake_unavailable` is {mooncake!r}; expected a string or null")
    return {
        "spec": dict(spec),
        "versions": {str(k): v for k, v in versions.items()},
        "mooncake_unavailable": mooncake,
    }


def ensure_venv(venv: Path, show: bool = True) -> Stamp:
    """Creates the peers' environment once; returns its stamp (versions, Mooncake's status).
    A stamp from other pins is redone; a failed LMCache step raises, naming the step."""
    spec: dict[str, object] = {
        "torch": list(TORCH), "lmcache": LMCACHE, "light": list(LMCACHE_LIGHT), "mooncake": MOONCAKE,
    }  # fmt: skip
    stamp_path = venv / STAMP
    if stamp_path.exists():
        old = _read_stamp(stamp_path, spec)
        if old is not None:
            return old
    python = venv / "bin" / "python"
    if not python.exists():
        step(f"create the venv {venv}", [sys.executable, "-m", "venv", str(venv)], show)
    pip = [str(python), "-m", "pip", "install"]
    step(f"install {' '.join(TORCH)} from PyPI", [*pip, *TORCH], show)
    step("install lmcache's light requirements", [*pip, *LMCACHE_LIGHT], show)
    step(f"install {LMCACHE} --no-deps", [*pip, "--no-deps", LMCACHE], show)
    imports = "from lmcache.v1.cache_engine import LMCacheEngineBuilder; import lmcache.v1.storage_backend"
    step("import lmcache's CPU path", [str(python), "-c", imports], show)
    mooncake = install_mooncake(python, show)
    names = ["lmcache", "torch", "numpy", "mooncake-transfer-engine-non-cuda"]
    code = (
        "import importlib.metadata as m, json\n"
        f"print(json.dumps({{n: (m.version(n) if any(True for _ in m.distributions(name=n)) else None) for n in {names}}}))"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    stamp: Stamp = {"spec": spec, "versions": json.loads(proc.stdout), "mooncake_unavailable": mooncake}
    stamp_path.write_text(json_text(stamp, indent=2, sort_keys=True))
    return stamp


# ---------------------------------------------------------------- servers and workers
def worker(python: Path | str, side: str, part: str, spec: Spec) -> WorkerResult:
    """One worker process; its RESULT, or ``{"error": ...}`` with the end of its output (or with
    the field its RESULT lacks or gives the wrong type)."""
    env = {**os.environ, **PEER_ENV} if side != "kvtier" else None
    cmd = [str(python), "-P", str(WORKER), side, part, json_text(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": f"{side} {part} worker ran past 900 s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {
            "error": f"{side} {part} worker exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"
        }
    try:
        return parse_result(json.loads(lines[-1][len("RESULT ") :]), f"{side} {part} worker's RESULT")
    except (KvtierError, ValueError) as e:
        return {"error": str(e)}


def parse_result(data: object, where: str) -> WorkerResult:
    """A worker's RESULT (untrusted JSON) as a :class:`WorkerResult`; a :class:`KvtierError` names
    ``where`` and the missing or ill-typed field."""
    if not isinstance(data, dict):
        raise KvtierError(f"{where} is not a JSON object")
    out: WorkerResult = {}
    if "ops" in data:
        ops = field_of(data, "ops", dict, where)
        out["ops"] = {str(op): field_of(ops, op, float, f"{where}: ops") for op in ops}
    if "memcpy_s" in data:
        out["memcpy_s"] = field_of(data, "memcpy_s", float, where)
    if "bytes" in data:
        out["bytes"] = field_of(data, "bytes", int, where)
    if "config" in data:
        out["config"] = field_of(data, "config", str, where)
    return out


@contextmanager
def _mooncake(venv: Path, workdir: Path) -> Iterator[Spec]:
    """``mooncake_master`` (with its HTTP metadata server) and a segment-holder process."""
    with mooncake_master(venv, workdir) as master:
        spec: Spec = {"metadata": master["metadata"], "master": master["master"], "segment_bytes": 2**29}
        holder_cmd = [str(venv / "bin" / "python"), "-P", str(WORKER), "mooncake", "holder", json_text(spec)]
        holder_log = workdir / "holder.log"
        with open(holder_log, "wb") as log:
            env = {**os.environ, **PEER_ENV}
            holder = subprocess.Popen(holder_cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 60
            while b"READY" not in holder_log.read_bytes():
                if holder.poll() is not None or time.monotonic() > deadline:
                    raise KvtierError(f"mooncake holder did not start: {holder_log.read_text()[-1500:]}")
                time.sleep(0.2)
            yield spec
        finally:
            stop(holder)


def run(
    venv: Path,
    rounds: int = 5,
    total_bytes: int = 2**30,
    threads: int = 0,
    show: bool = True,
    parts: tuple[str, ...] = tuple(PARTS),
    ssd_bytes: int = 2**29,
    ssd_dir: str | None = None,
    ssd_codec: str = "raw",
) -> PeersResult:
    """Every row of ``parts``, ``rounds`` times, kvtier and the peer alternating; see the module docs."""
    stamp = ensure_venv(venv, show)
    python = venv / "bin" / "python"
    base: Spec = {
        "bytes": total_bytes,
        "lookup_tokens": LOOKUP_TOKENS,
        "lookup_repeats": 20,
        "copy_threads": threads,
        "ssd_bytes": ssd_bytes,
        "ssd_codec": ssd_codec,
    }
    if "ssd" in parts:  # computed here, once, where the wheel lacks it: the peers' side has no kvtier
        base["kv_fixture"] = str(kv_fixture.fixture_path())
    unavailable: dict[str, str] = {}
    if stamp["mooncake_unavailable"]:
        unavailable["mooncake"] = stamp["mooncake_unavailable"]
    per_round: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-peers-") as tmp, _redis(tmp, parts) as redis:
        base["redis_url"] = redis.get("redis_url")
        base["redis_server"] = redis.get("redis_server")
        base["ssd_root"] = str(Path(ssd_dir or tmp).resolve())
        with _servers(venv, Path(tmp), unavailable, "remote" in parts) as mooncake:
            base.update(mooncake)
            for r in range(rounds):
                done: Round = {}
                for part, peer in PARTS.items():
                    if part not in parts or peer in unavailable:
                        continue
                    _say(show, f"round {r + 1}/{rounds}: {part}")
                    spec = base.copy()
                    spec["seed"] = r
                    sides: list[tuple[str, Path | str]] = [("kvtier", sys.executable), (peer, python)]
                    out: PartRound = {}
                    for side, interpreter in sides if r % 2 == 0 else sides[::-1]:
                        out[side] = worker(interpreter, side, part, spec)
                    out["load_avg_1m"] = os.getloadavg()[0]
                    done[part] = out
                per_round.append(done)
        ssd_filesystem = filesystem_of(Path(base["ssd_root"]))
    return PeersResult(
        bytes=total_bytes,
        rounds=rounds,
        parts=list(parts),
        copy_threads=threads,
        ssd_bytes=ssd_bytes,
        ssd_filesystem=ssd_filesystem,
        ssd_codec=ssd_codec,
        versions=stamp["versions"],
        redis_server=base["redis_server"],
        python=sys.version.split()[0],
        unavailable=unavailable,
        not_measured=NOT_MEASURED,
        rows=aggregate(per_round, unavailable, parts),
        per_round=per_round,
    )


@contextmanager
def _redis(tmp: str, parts: tuple[str, ...]) -> Iterator[Spec]:
    """A loopback Redis for kvtier's remote row, when that part runs, set up for 4 MiB values as
    docs/remote.md recommends (jemalloc keeps freed reply buffers: ``LARGE_VALUE_MALLOC_CONF``);
    yields its URL and what ran (binary, version, ``MALLOC_CONF``), or ``{}``."""
    if "remote" not in parts:
        yield {}
        return
    from kvtier.testing.redis import LARGE_VALUE_MALLOC_CONF, LocalRedis

    with LocalRedis(tmp, malloc_conf=LARGE_VALUE_MALLOC_CONF) as redis:
        version = subprocess.run([redis.server, "--version"], capture_output=True, text=True).stdout.strip()
        server = {"binary": redis.server, "version": version, "malloc_conf": LARGE_VALUE_MALLOC_CONF}
        yield {"redis_url": redis.url, "redis_server": server}


@contextmanager
def _servers(venv: Path, workdir: Path, unavailable: dict[str, str], wanted: bool) -> Iterator[Spec]:
    """Mooncake's servers when it runs; when they fail, ``unavailable["mooncake"]`` says why."""
    if "mooncake" in unavailable or not wanted:
        yield {}
        return
    try:
        cm = _mooncake(venv, workdir)
        spec = cm.__enter__()
    except KvtierError as e:
        unavailable["mooncake"] = str(e)
        yield {}
        return
    try:
        yield spec
    finally:
        cm.__exit__(None, None, None)
