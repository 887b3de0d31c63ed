"""The simulator compiled: the same source, its hot modules built by mypyc (issue 20).

The ``.py`` files of this package are the simulator. :func:`build` copies the package to a folder of
its own and compiles the modules a replay spends its time in (:data:`MODULES`: the event loop, the
engine's step, the views, the prefix index, the policies the scaling bench replays) to C extensions
with mypyc, the compiler mypy ships; it writes a manifest of every file it was built from.
:func:`fresh_tree` says whether such a copy still matches this source, file by file, and why not.
Nothing here changes how ``kvtier`` imports: a process runs the compiled copy only when started with
the copy first on ``sys.path`` (``kvtier bench sim --scaling --build``, :func:`child_env`), and a
replay reports the build it ran (:func:`running_build`), read from its modules, not assumed.

Why a copy and not mypyc's usual in-place build: an extension module beside its ``.py`` shadows any
edit of the source until rebuilt, and the test suite patches and subclasses classes that are native
once compiled, so the suite runs on the source and the copy is checked against it by replaying
(tests/test_sim_compiled.py: every policy's per-request records equal the committed fixture's).

Compiled code trusts the types mypy inferred: where the source relies on something mypy cannot see
(an attribute changed inside a call, narrowed before it), the compiled module raises ``TypeError``
instead of running on; such places are written so mypy sees them right (``Cluster._take_placed``).

Enum members a compiled module reads per request come from :mod:`kvtier.sched.members` (compiled
here too: a ``Final`` there is a C static where ``Phase.RUNNING`` is a call through Python 3.11's
``EnumType.__getattr__`` hook).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.results import json_text

#: The package this module belongs to: what a build copies and what a copy is checked against.
PACKAGE = Path(__file__).resolve().parents[1]
#: The modules compiled, relative to the package. Left out on purpose: ``sched/static_swap.py``
#: (its decorated subclasses of a compiled base would be Python classes, which mypyc refuses),
#: ``sched/placement.py`` (its routers' ``name`` is read off the class) and ``sched/base.py``
#: (the views are filled slot by slot, which a native class refuses).
MODULES = (
    "sim/core.py",
    "sim/engine.py",
    "sim/view.py",
    "sim/state.py",
    "sim/swap.py",
    "sim/resources.py",
    "sim/metrics.py",
    "sim/events/step_end.py",
    "sim/events/arrival.py",
    "sim/fast_forward.py",
    "sim/loads.py",
    "sim/tiers.py",
    "sim/arrivals.py",
    "sim/step_time.py",
    "sim/stall.py",
    "sim/cluster.py",
    "sim/cost.py",
    "sim/models.py",
    "sim/request.py",
    "sim/workload/mooncake.py",
    "sched/members.py",
    "sched/rota_seen.py",
    "sched/lvf.py",
    "sched/executor.py",
    "sched/step_plan.py",
    "sched/rotasched.py",
    "sched/claims.py",
    "sched/composed.py",
    "sched/batching.py",
    "sched/strata.py",
    "sched/hicache.py",
    "sched/load_path.py",
    "sched/swap_copy.py",
    "sched/fetch_path.py",
    "sched/kv_io.py",
    "radix/tree.py",
    "radix/watch.py",
    "radix/counts.py",
    "radix/match.py",
)
MANIFEST = "KVTIER_COMPILED.json"
BUILDS = ("auto", "python", "compiled")
_SKIPPED = ("__pycache__", "*.so", "*.pyd", "*.pyc")
_CORE = "_core.abi3.so"  # the Rust extension: linked into the copy, not copied (a rebuild shows)


def default_dir() -> Path:
    """Where :func:`build` writes and the bench looks: ``$KVTIER_COMPILED_DIR``; the copy this
    process runs from, if it does; in a checkout, its ``build/sim-compiled``; else
    ``~/.cache/kvtier/sim-compiled``."""
    env = os.environ.get("KVTIER_COMPILED_DIR")
    if env:
        return Path(env)
    if (PACKAGE.parent / MANIFEST).is_file():  # this process runs from a compiled copy: that one
        return PACKAGE.parent
    root = PACKAGE.parents[1]
    if PACKAGE.parent.name == "python" and (root / "pyproject.toml").is_file():
        return root / "build" / "sim-compiled"
    return Path.home() / ".cache" / "kvtier" / "sim-compiled"


def source_files(package: Path = PACKAGE) -> dict[str, str]:
    """Every file of ``package`` a build copies (not caches, not extension modules), by path
    relative to it, with its SHA-256."""
    out: dict[str, str] = {}
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if path.is_dir() or _skipped(rel):
            continue
        out[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _skipped(rel: Path) -> bool:
    return "__pycache__" in rel.parts or rel.suffix in (".so", ".pyd", ".pyc")


def _python() -> str:
    return f"{sys.implementation.name} {sys.version.split()[0]}"


def write_manifest(tree: Path, files: Mapping[str, str], modules: tuple[str, ...] = MODULES) -> None:
    """Records in ``tree`` what it was built from (``files``: :func:`source_files` of the package
    as it was copied), for this Python, with ``modules`` compiled."""
    manifest = {"python": _python(), "modules": list(modules), "files": dict(files)}
    (tree / MANIFEST).write_text(json_text(manifest, indent=1, sort_keys=True) + "\n")


def stale_reason(tree: Path, package: Path = PACKAGE) -> str | None:
    """None where ``tree`` is a compiled copy of ``package`` as it is now, for this Python; else
    what differs (the first changed, added or removed file is named)."""
    manifest_path = tree / MANIFEST
    if not manifest_path.is_file():
        return f"no compiled build at {tree}"
    try:
        manifest = json.loads(manifest_path.read_text())
        built: Mapping[str, str] = manifest["files"]
        python = manifest["python"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest_path} is not a build manifest ({e})"
    if python != _python():
        return f"{tree} was built for {python}; this is {_python()}"
    now = source_files(package)
    for rel in sorted(now.keys() | built.keys()):
        if rel not in built:
            return f"{rel} was added to {package} after the build at {tree}"
        if rel not in now:
            return f"{rel} was removed from {package} after the build at {tree}"
        if now[rel] != built[rel]:
            return f"{rel} changed after the build at {tree}"
    for rel in manifest.get("modules", ()):
        if not any((tree / "kvtier" / rel).parent.glob(Path(rel).stem + ".*.so")):
            return f"{tree} lacks the compiled {rel}"
    return None


def fresh_tree(build: str = "auto", tree: Path | None = None) -> Path | None:
    """The folder to put first on a replay's ``sys.path`` for ``build``: None for ``python``; the
    compiled copy for ``compiled`` (raises, saying why and how to build, where it is missing or
    stale); for ``auto`` the copy where it is fresh, else None."""
    if build not in BUILDS:
        raise KvtierError(f"build is {build!r}; expected one of {', '.join(BUILDS)}")
    if build == "python":
        return None
    tree = tree or default_dir()
    reason = stale_reason(tree)
    if reason is None:
        return tree
    if build == "compiled":
        raise KvtierError(
            f"no fresh compiled simulator: {reason}; `kvtier sim compile` builds it (about a minute)"
        )
    return None


def child_env(tree: Path | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's) for a child that imports kvtier from ``tree`` (compiled) or from
    this package's own folder (``tree`` None), whatever the child's working directory."""
    out = dict(os.environ if env is None else env)
    first = str(tree) if tree is not None else str(PACKAGE.parent)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (first, out.get("PYTHONPATH")) if p)
    return out


def running_build() -> str:
    """``compiled`` where this process's simulator modules are mypyc's extensions, else ``python``
    (read from the loaded modules: every compiled one, or none, else the copy is broken)."""
    names = ["kvtier." + m.removesuffix(".py").replace("/", ".") for m in MODULES]
    compiled = [not (import_module(n).__file__ or "").endswith(".py") for n in names]
    if all(compiled):
        return "compiled"
    if not any(compiled):
        return "python"
    mixed = [n for n, c in zip(names, compiled, strict=True) if not c]
    raise KvtierError(f"a partly compiled simulator: {', '.join(mixed)} not compiled; rebuild it")


def build(out: Path | None = None, show: bool = True, opt_level: str = "3") -> Path:
    """Copies this package to ``out`` (:func:`default_dir`) and compiles :data:`MODULES` there
    with mypyc, the C compiler at ``-O<opt_level>`` (a test's copy takes ``1``: a quarter less CPU
    time to build, the same results); the compiler's output goes to ``<out>.build.log`` beside it. The copy replaces the
    folder only once built and checked (a failed build leaves the previous one). Needs mypy (with mypyc), setuptools and a C
    compiler with this Python's headers."""
    if opt_level not in ("0", "1", "2", "3"):
        raise KvtierError(f"opt_level is {opt_level!r}; expected one of 0, 1, 2, 3")
    missing = [m for m in ("mypyc", "setuptools") if find_spec(m) is None]
    if missing:
        raise KvtierError(
            f"`kvtier sim compile` needs {' and '.join(missing)}: pip install mypy setuptools "
            "(make build installs both)"
        )
    out = (out or default_dir()).resolve()
    if out.exists() and not out.is_dir():
        raise KvtierError(f"compiled build folder {out} is a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    files = source_files()
    work = Path(tempfile.mkdtemp(prefix=".sim-compiled-", dir=out.parent))
    try:
        shutil.copytree(PACKAGE, work / "kvtier", ignore=shutil.ignore_patterns(*_SKIPPED))
        core = PACKAGE / _CORE
        if core.exists():
            (work / "kvtier" / _CORE).symlink_to(core)
        log = out.with_name(out.name + ".build.log")
        started = time.monotonic()
        if show:
            print(
                f"compiling {len(MODULES)} simulator modules with mypyc into {out} (about a minute)",
                file=sys.stderr,
            )
        _mypyc(work, log, opt_level)
        for leftover in ("build", ".mypy_cache", "kvtier_sim_compiled.egg-info"):
            shutil.rmtree(work / leftover, ignore_errors=True)
        write_manifest(work, files)
        reason = stale_reason(work)
        if reason is not None:  # the source changed while it compiled, or a module did not build
            raise KvtierError(f"compiled build not usable: {reason}; see {log}")
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    if show:
        print(f"compiled simulator built in {time.monotonic() - started:.0f} s: {out}", file=sys.stderr)
    return out


_SETUP = """
from mypyc.build import mypycify
from setuptools import setup
setup(name="kvtier_sim_compiled", packages=[], script_args=["build_ext", "--inplace", "-j", "{jobs}"],
      ext_modules=mypycify({modules!r}, opt_level={opt_level!r}))
"""


def _mypyc(work: Path, log: Path, opt_level: str) -> None:
    """Runs mypyc on :data:`MODULES` in ``work`` (a child process: setuptools and mypyc change the
    working directory and global state); raises with the log's tail where it fails."""
    modules = ["kvtier/" + m for m in MODULES]
    script = _SETUP.format(modules=modules, jobs=os.cpu_count() or 1, opt_level=opt_level)
    env = dict(os.environ, MYPYPATH=str(work), PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1")
    with log.open("w") as f:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=work, stdout=f, stderr=subprocess.STDOUT, env=env, check=False
        )
    if done.returncode != 0:
        raise KvtierError(build_failure(done.returncode, log, shutil.disk_usage(work).free))


# A line of a build log that says what failed: a compiler's or mypy's error, a traceback, a full disk
# or a killed compiler. Word bounds keep gcc's `-Werror` flags out.
_FAILURE_LINE = re.compile(r"\b(error|fatal|Traceback|No space left on device|Killed|MemoryError)\b")


def build_failure(returncode: int, log: Path, free_bytes: int) -> str:
    """What a failed mypyc build says: the log's lines that name a failure (the first 20; a
    parallel build's error is rarely at its end, the other compiles go on after it), its last 15
    lines, and the free space where it built (a full disk fails it without a compiler error)."""
    lines = log.read_text(errors="replace").splitlines()
    failures = [line for line in lines if _FAILURE_LINE.search(line)][:20]
    said = "\n".join(failures) if failures else "(no line of it names an error)"
    return (
        f"mypyc failed (exit {returncode}; {free_bytes / 2**30:.1f} GiB free where it built); what {log} says"
        f" failed:\n{said}\nits end:\n" + "\n".join(lines[-15:])
    )


def add_build_argument(cmd: Any, default: str) -> None:
    """The ``--build`` option of a command that replays (``kvtier bench sim``, ``kvtier sim run``)."""
    cmd.add_argument(
        "--build",
        choices=BUILDS,
        default=default,
        help=f"the simulator: python, compiled (kvtier sim compile) or auto (compiled where fresh); default {default}",
    )


def add_command(sim_sub: Any) -> None:
    """`kvtier sim compile` (registered by the CLI beside `sim run`)."""
    cmd = sim_sub.add_parser(
        "compile", help="build the simulator's hot modules with mypyc (kvtier bench sim uses it)"
    )
    cmd.add_argument("--out", default=None, help="folder of the compiled copy (default: build/sim-compiled)")
    cmd.add_argument(
        "--check", action="store_true", help="only say whether the copy is fresh (exit 2 if not)"
    )

    def main(args: argparse.Namespace) -> None:
        out = Path(args.out) if args.out else default_dir()
        if args.check:
            reason = stale_reason(out)
            if reason is not None:
                raise KvtierError(reason)
            print(f"fresh: {out} ({len(MODULES)} modules compiled)")
            return
        build(out)

    cmd.set_defaults(func=main)
