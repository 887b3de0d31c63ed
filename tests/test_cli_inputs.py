"""The command line against a user's own inputs: traces, configs, output paths, flags and Ctrl-C.
Every bad input is one ``kvtier: error: ...`` line naming it and exit status 2 (no traceback); an
interrupted command exits 130 and leaves no output that looks complete. (The trace readers' own
line-by-line checks are in tests/test_sim_workload.py.)"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gzip
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest

from kvtier import cli, results

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
TINY = (
    "name: tiny\n"
    "hardware: h100-sxm\n"
    "model: llama-3.1-8b\n"
    "block_tokens: 16\n"
    "workload: {name: multiturn, num_sessions: 3, rate_per_s: 1.0}\n"
)


def small_trace(tmp_path: Path, name: str = "trace.jsonl", lines: int = 5) -> Path:
    path = tmp_path / name
    with TRACE.open() as source:
        path.write_text("".join(next(source) for _ in range(lines)))
    return path


def error_of(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_an_empty_trace_is_refused_by_sim_run_and_sim_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for command in (["sim", "run", str(empty)], ["sim", "size", str(empty), "--max-engines", "4"]):
        assert cli.main(command) == 2
        assert f"{empty}: no requests" in error_of(capsys)


def test_a_compressed_trace_suffix_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # x.jsonl.gz was read as a YAML sim config: "is not UTF-8 text; expected a YAML file".
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(small_trace(tmp_path).read_bytes()))
    assert cli.main(["sim", "run", str(packed)]) == 2
    assert "compressed trace" in error_of(capsys)


def test_ctrl_c_exits_130_without_a_traceback_or_an_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvtier.sim.run.run", interrupted)
    out = tmp_path / "result.json"
    assert cli.main(["sim", "run", str(small_trace(tmp_path)), "--out", str(out)]) == 130
    assert "kvtier: interrupted" in error_of(capsys)
    assert not out.exists()


def test_an_output_that_fails_midway_leaves_the_old_file_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "result.json"
    out.write_text('{"old": true}')
    real_replacing = results.replacing

    class DiskFull:
        def __init__(self, file: TextIO) -> None:
            self.file = file

        def write(self, text: str) -> int:
            self.file.write(text[:20])  # part of the document, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    @contextlib.contextmanager
    def disk_full(path: str) -> Iterator[DiskFull]:
        with real_replacing(path) as file:  # the real temp file and rename: only the write fails
            yield DiskFull(file)

    monkeypatch.setattr(results, "replacing", disk_full)
    assert cli.main(["sim", "run", str(small_trace(tmp_path)), "--out", str(out), "--json"]) == 2
    assert "No space left on device" in error_of(capsys)
    assert out.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "trace.jsonl"]  # no temp file


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        # Mistyped values are named with what they are.
        ('gpu_memory_utilization: "0.9"', "`gpu_memory_utilization` is '0.9'"),
        ('max_sim_s: "10"', "`max_sim_s` is '10'"),
        ("max_sim_s: .nan", "`max_sim_s` is nan"),
        ("slo: {ttft_s: .nan}", "slo `ttft_s` is nan"),
        ("slo: {ttft_s: true}", "slo `ttft_s` is True"),
        # Misspelt names get the close match.
        ("policy: {name: hicach}", "did you mean 'hicache'?"),
        ("hardware: h100sxm", "did you mean 'h100-sxm'?"),
        ("model: llama-3.1-8", "did you mean 'llama-3.1-8b'?"),
        ("workload: {name: multiturnn, num_sessions: 3}", "did you mean 'multiturn'?"),
        ("workload: {name: multiturn, num_sesions: 3}", "did you mean 'num_sessions'?"),
        ("router: least-loaded", "did you mean 'least_loaded'?"),
        ("enginez: 2", "did you mean 'engines'?"),
        ("policy: {name: hicache, bogus: 1}", "`bogus`"),
    ],
)
def test_a_mistyped_value_or_misspelt_name_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, needle: str
) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text(TINY + line + "\n")
    assert cli.main(["sim", "run", str(config)]) == 2
    assert needle in error_of(capsys)


@pytest.mark.parametrize("bench", ["layout", "store", "codec", "transfer"])
def test_a_negative_thread_count_is_refused_before_the_bench(
    bench: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench codec raised ValueError("max_workers must be greater than 0"); bench transfer failed
    # only after building its stores and calibrating.
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench", bench, "--threads", "-1"])
    assert exit.value.code == 2
    assert "argument --threads: -1 is not >= 0" in error_of(capsys)


@pytest.mark.parametrize("flags", [["--copies", "4"], ["--policies", "fcfs"], ["--engines", "2"]])
def test_bench_sim_refuses_scaling_flags_without_scaling(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    # They were silently ignored: the plain bench ran the trace once on one engine.
    assert cli.main(["bench", "sim", *flags]) == 2
    assert f"{flags[0]} applies to --scaling" in error_of(capsys)


def test_every_flag_of_every_command_is_described() -> None:
    undescribed = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                undescribed.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(cli.build_parser(), "kvtier")
    assert not undescribed


def test_sim_sweep_checks_every_policy_before_the_first_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A typo in the second policy was found only after the first one's whole sweep had run.
    swept: list[str] = []
    monkeypatch.setattr("kvtier.sim.run.sweep", lambda config, *a, **k: swept.append(config.policy["name"]))
    config = tmp_path / "sim.yaml"
    config.write_text(TINY)
    args = ["sim", "sweep", str(config), "--rates", "1", "--out-dir", str(tmp_path / "out")]
    assert cli.main([*args, "--policies", "fcfs,hicach"]) == 2
    assert "unknown policy 'hicach' (did you mean 'hicache'?)" in error_of(capsys)
    assert swept == []


def test_sim_sweep_of_a_trace_says_it_has_no_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The trace was parsed as YAML: a multi-line "not valid YAML" error quoting the JSON.
    args = ["sim", "sweep", str(small_trace(tmp_path)), "--rates", "1", "--out-dir", str(tmp_path / "out")]
    assert cli.main(args) == 2
    assert "workload 'mooncake' has no parameter(s) rate_per_s" in error_of(capsys)


def test_a_trace_path_that_is_a_directory_is_named_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "traces.jsonl"
    folder.mkdir()
    assert cli.main(["sim", "run", str(folder)]) == 2
    assert f"trace {str(folder)!r} is a directory; expected a trace file" in error_of(
        capsys
    )  # was "does not exist"


def test_a_closed_stdout_ends_the_command_quietly(tmp_path: Path) -> None:
    # `kvtier sim run trace --json | head -c 10`: the reader leaves before the JSON is printed; that
    # was "kvtier: error: Broken pipe" and status 2, as if the run had failed.
    command = [sys.executable, "-m", "kvtier.cli", "sim", "run", str(small_trace(tmp_path)), "--json"]
    done = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert done.stdout is not None and done.stderr is not None
    done.stdout.close()  # before the replay ends: its first write finds no reader
    err = done.stderr.read().decode()
    assert done.wait() == 141 and err == ""


def test_json_output_keeps_the_progress_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # --json silenced the progress bar, which goes to stderr (and only to a terminal): a long
    # `sim run --json > out.json` showed nothing for minutes.
    shown: list[bool] = []

    def run(config: Any, show_progress: bool = False, *args: Any, **kwargs: Any) -> None:
        shown.append(show_progress)
        raise KeyboardInterrupt  # enough: what matters is how it was called

    monkeypatch.setattr("kvtier.sim.run.run", run)
    assert cli.main(["sim", "run", str(small_trace(tmp_path)), "--json"]) == 130
    monkeypatch.setattr("kvtier.bench.sim.run_sim", run)
    assert cli.main(["bench", "sim", "--json", "--max-requests", "5"]) == 130
    assert shown == [True, True]


def test_an_out_path_the_system_refuses_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.access passes for root, on read-only mounts and under ACLs: `--out /sys/x.json` replayed
    # the whole trace, then failed to write. Here the system refuses every file in `locked`.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_open = Path.open

    def refusing(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path.parent == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    ran: list[object] = []
    monkeypatch.setattr(Path, "open", refusing)
    monkeypatch.setattr("kvtier.sim.run.run", lambda *a, **k: ran.append(a) or {})
    assert cli.main(["sim", "run", str(small_trace(tmp_path)), "--out", str(locked / "r.json")]) == 2
    assert "--out" in error_of(capsys) and ran == []
