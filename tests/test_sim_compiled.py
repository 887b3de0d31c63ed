"""The simulator compiled by mypyc (kvtier.sim.compiled): a real build, checked by replaying.

The compiled copy must decide exactly what the source decides: every per-engine policy's per-request
records equal the committed fixture's (the same fixture tests/test_sim_records.py holds the source
to), the bench's rows (DualPath's P/D cluster too) equal the Python simulator's, and every row says
which build it ran. A copy that no longer matches the source is never used silently. The build is
real (mypyc and the C compiler, about a minute); it is made once per session, in a temporary folder
unless the default one is fresh already.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sim_records
from kvtier import cli
from kvtier.bench.sim import scaling
from kvtier.errors import KvtierError
from kvtier.sched import policy_names
from kvtier.sched.base import policy_class
from kvtier.sim import compiled

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fresh = compiled.fresh_tree("auto")
    if fresh is not None:
        return fresh
    # -O1: gcc's optimisation level changes no result here (no fast-math, no FMA on the default
    # x86-64 target), and the replays below would show it if it did; -O3 took 228 s of CPU, -O1 167.
    return compiled.build(tmp_path_factory.mktemp("compiled") / "sim-compiled", show=False, opt_level="1")


def test_the_compiled_copy_replays_every_policy_to_the_fixtures_records(tree: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(TESTS / "sim_records.py"), "--print"],
        stdout=subprocess.PIPE,
        text=True,
        env=compiled.child_env(tree),
        check=True,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["build"] == "compiled"  # its modules were the extensions, not the .py files
    assert sorted(out["records"]) == sorted(sim_records.POLICIES)
    fixture = json.loads(sim_records.FIXTURE.read_text())
    for policy, got in out["records"].items():
        assert got == fixture[policy], policy


def test_the_bench_rows_name_their_build_and_match_the_python_simulators(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_COMPILED_DIR", str(tree))
    args = (("rotasched", "dualpath"), (1,), 300, (1,))
    fast, slow = scaling(*args, build="compiled").rows, scaling(*args, build="python").rows
    assert [r.build for r in fast] == ["compiled", "compiled"]
    assert [r.build for r in slow] == ["python", "python"]
    for a, b in zip(fast, slow, strict=True):
        assert (a.policy, a.requests, a.unfinished_requests, a.events) == (
            b.policy,
            b.requests,
            b.unfinished_requests,
            b.events,
        )
        assert (a.ttft_mean_s, a.ttft_p90_s) == (b.ttft_mean_s, b.ttft_p90_s)  # exactly


def test_this_process_runs_the_source() -> None:
    assert compiled.running_build() == "python"


def test_a_policy_declares_the_transfer_budget_its_constructor_takes() -> None:
    # kvtier.sim.xfer reads the declaration, since a compiled class has no signature to read.
    for name in policy_names():
        cls = policy_class(name)
        takes = "xfer_blocks" in inspect.signature(cls).parameters
        assert cls.takes_xfer_blocks == takes, name
    assert policy_class("rotasched").takes_xfer_blocks and policy_class("composed").takes_xfer_blocks


def _manifested(tmp_path: Path) -> Path:
    """A folder whose manifest records this package as it is (no module compiled: the check of
    the files alone)."""
    compiled.write_manifest(tmp_path, compiled.source_files(), modules=())
    return tmp_path


def test_a_copy_of_this_source_is_fresh_and_any_change_is_named(tmp_path: Path) -> None:
    tree = _manifested(tmp_path)
    assert compiled.stale_reason(tree) is None
    assert compiled.fresh_tree("compiled", tree) == tree
    manifest = json.loads((tree / compiled.MANIFEST).read_text())
    files = dict(manifest["files"])

    def with_files(changed: dict[str, str]) -> str | None:
        manifest["files"] = changed
        (tree / compiled.MANIFEST).write_text(json.dumps(manifest))
        return compiled.stale_reason(tree)

    assert (
        with_files({**files, "sim/engine.py": "0" * 64}) == f"sim/engine.py changed after the build at {tree}"
    )
    assert with_files({k: v for k, v in files.items() if k != "sim/core.py"}) == (
        f"sim/core.py was added to {compiled.PACKAGE} after the build at {tree}"
    )
    assert with_files({**files, "sim/gone.py": "0" * 64}) == (
        f"sim/gone.py was removed from {compiled.PACKAGE} after the build at {tree}"
    )
    manifest["files"], manifest["python"] = files, "cpython 2.7.18"
    (tree / compiled.MANIFEST).write_text(json.dumps(manifest))
    assert "was built for cpython 2.7.18" in str(compiled.stale_reason(tree))


def test_a_manifest_naming_modules_it_lacks_is_stale(tmp_path: Path) -> None:
    compiled.write_manifest(tmp_path, compiled.source_files(), modules=("sim/engine.py",))
    assert compiled.stale_reason(tmp_path) == f"{tmp_path} lacks the compiled sim/engine.py"


def test_no_build_or_a_broken_manifest_is_named(tmp_path: Path) -> None:
    assert compiled.stale_reason(tmp_path) == f"no compiled build at {tmp_path}"
    (tmp_path / compiled.MANIFEST).write_text("{not json")
    assert "is not a build manifest" in str(compiled.stale_reason(tmp_path))
    (tmp_path / compiled.MANIFEST).write_text("{}")
    assert "is not a build manifest" in str(compiled.stale_reason(tmp_path))


def test_an_unknown_optimisation_level_is_refused_before_any_copy(tmp_path: Path) -> None:
    with pytest.raises(KvtierError, match="opt_level is '-O2'; expected one of 0, 1, 2, 3"):
        compiled.build(tmp_path / "out", show=False, opt_level="-O2")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_names_the_error_a_parallel_build_left_mid_log_and_the_free_space(
    tmp_path: Path,
) -> None:
    gcc = "gcc -O1 -g1 -Werror -Wno-unused-function -c build/kvtier/sim/{m}.c -o build/{m}.o"
    lines = [gcc.format(m=m) for m in ("engine", "cost")]
    lines += ["build/kvtier/sim/cost.c:12:3: error: 'x' undeclared (first use in this function)"]
    lines += [gcc.format(m=f"view{i}") for i in range(20)]  # the other job's compiles go on after it
    lines += ["/usr/bin/ld: final link failed: No space left on device"]
    log = tmp_path / "sim-compiled.build.log"
    log.write_text("\n".join(lines) + "\n")
    said = compiled.build_failure(1, log, 3 << 29)
    assert said.startswith("mypyc failed (exit 1; 1.5 GiB free where it built)"), said
    failed = said.split("failed:\n", 1)[1].split("\nits end:\n")[0].splitlines()
    assert failed == [lines[2], lines[-1]], "the failure lines, and no compile line for its -Werror flag"
    assert said.splitlines()[-1] == lines[-1] and said.count("gcc -O1") == 14
    log.write_text("\n".join(lines[:2]) + "\n")
    assert "(no line of it names an error)" in compiled.build_failure(-9, log, 0)


def test_a_stale_copy_is_refused_when_asked_for_and_passed_over_on_auto(tmp_path: Path) -> None:
    with pytest.raises(
        KvtierError, match=r"no fresh compiled simulator: no compiled build at .*kvtier sim compile"
    ):
        compiled.fresh_tree("compiled", tmp_path)
    assert compiled.fresh_tree("auto", tmp_path) is None
    assert compiled.fresh_tree("python", tmp_path) is None
    with pytest.raises(KvtierError, match="build is 'fast'; expected one of auto, python, compiled"):
        compiled.fresh_tree("fast", tmp_path)


def test_the_commands_say_why_a_copy_is_not_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sim", "compile", "--check", "--out", str(tmp_path)]) == 2
    assert f"no compiled build at {tmp_path}" in capsys.readouterr().err
    monkeypatch.setenv("KVTIER_COMPILED_DIR", str(tmp_path))
    argv = ["bench", "sim", "--scaling", "--policies", "fcfs", "--copies", "1", "--max-requests", "20"]
    assert cli.main([*argv, "--engines", "1", "--build", "compiled"]) == 2
    assert "no fresh compiled simulator" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main(["sim", "compile", "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_sim_run_on_the_compiled_copy_prints_the_python_runs_figures(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_COMPILED_DIR", str(tree))
    trace = str(compiled.PACKAGE / "data" / "traces" / "mooncake_synthetic_trace.jsonl")
    runs = {}
    for build in ("compiled", "python"):
        out = tmp_path / f"{build}.json"
        argv = ["sim", "run", trace, "--policy", "rotasched", "--engines", "2", "--out", str(out)]
        assert cli.main([*argv, "--build", build, "--json"]) == 0
        runs[build] = json.loads(out.read_text())
    said = capsys.readouterr().err
    assert f"replaying on the compiled simulator ({tree})" in said
    timed = {"wall_s", "cpu_s", "events_per_s", "peak_rss_bytes"}
    got, want = ({k: v for k, v in r.items() if k not in timed} for r in (runs["compiled"], runs["python"]))
    assert got == want and got["requests"] > 3000


def test_a_process_running_a_copy_finds_that_copy(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_COMPILED_DIR", raising=False)
    done = subprocess.run(
        [sys.executable, "-c", "from kvtier.sim import compiled; print(compiled.default_dir())"],
        stdout=subprocess.PIPE,
        text=True,
        env=compiled.child_env(tree),
        check=True,
    )
    assert Path(done.stdout.strip()) == tree
