"""`kvtier report` (kvtier.report): the real CLI turns what `kvtier sim reproduce` and
`kvtier sim run --out` wrote into one self-contained HTML page."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import KvtierError
from kvtier.report import reproduction_rows, sim_summary, write_html
from kvtier.results import json_text, nan_for_null
from kvtier.sim import size as sim_size
from kvtier.sim.run import SimResult
from kvtier.sim.run import run as run_sim

#: A run that ends before any request arrives: every latency figure is a mean of nothing (NaN).
NOTHING_FINISHES = (
    "name: nothing-finishes\nhardware: h100-sxm\nmodel: llama-3.1-8b\nblock_tokens: 16\nmax_sim_s: 0.001\n"
    "workload: {name: multiturn, num_sessions: 3, rate_per_s: 1.0}\n"
)


def strict_loads(text: str) -> object:
    """``text`` read as RFC 8259 JSON (no NaN or Infinity, as JavaScript, Go and jq read it)."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON (RFC 8259)")

    return json.loads(text, parse_constant=refuse)


def kvtier(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_report_of_a_reproduction_and_a_run_holds_every_row_and_plot_inline(tmp_path: Path) -> None:
    out = tmp_path / "sim-out"
    kvtier("sim", "reproduce", "strata", "--quick", "--out-dir", str(out))
    kvtier("sim", "run", "baselines/longdoc_h200", "--out", str(out / "run.json"), "--json")
    rows = json.loads((out / "rows.json").read_text())["rows"]
    plots = sorted(out.rglob("*.png"))
    assert rows and plots
    page_path = Path(kvtier("report", str(out)).strip())
    assert page_path == out / "report.html"
    page = page_path.read_text()
    for r in rows:  # every reproduction row, with kvtier's figure as printed
        assert r["metric"] in page and f"{r['kvtier_ratio']:.4g}" in page, r["metric"]
    assert "Run longdoc-h200" in page and "TTFT s   mean" in page
    assert len(re.findall(r'<img alt="[^"]+" src="data:image/png;base64,', page)) == len(plots)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing outside the page itself


def test_report_of_a_directory_without_results_names_it(tmp_path: Path) -> None:
    with pytest.raises(KvtierError, match="nothing to report"):
        write_html(tmp_path)
    with pytest.raises(KvtierError, match="not a directory"):
        write_html(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KvtierError, match=r"bad\.json"):
        write_html(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe{}", r"not a readable JSON file \('utf-8' codec"),
        (
            b'{"series": {"lru": [{"rate_per_s": 1}]}, "config": "c"}',
            r"sim sweep result but is not one \(no 'ttft_s'\)",
        ),
        (b'{"series": [1, 2]}', r"sim sweep result but is not one \(.*'list' object"),
        (b'{"ttft_s": {}, "config": "c"}', r"sim run result but is not one \(no 'tpot_s'\)"),
        (
            b'{"ttft_s": 1, "tpot_s": 1, "hit_rate_tokens": 1, "config": "c", "requests": 1, "model": "m", '
            b'"hardware": "h", "policy": {"name": "p"}}',
            r"sim run result but is not one \(.*'int' object is not subscriptable",
        ),
    ],
)
def test_a_result_file_that_is_not_what_it_looks_like_is_named(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(KvtierError, match=rf"{re.escape(str(tmp_path))}/x\.json: .*{message}"):
        write_html(tmp_path)
    (tmp_path / "other.json").write_text('{"panels": []}')  # a JSON file of something else: skipped
    (tmp_path / "x.json").unlink()
    with pytest.raises(KvtierError, match="nothing to report"):
        write_html(tmp_path)


def test_an_out_path_that_cannot_be_written_is_named_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rows.json").write_text('{"rows": []}')
    (tmp_path / "a-dir").mkdir()
    for out, problem in (
        (tmp_path / "a-dir", "is a directory"),
        (tmp_path / "no" / "r.html", "does not exist"),
    ):
        assert main(["report", str(tmp_path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and problem in err and ".tmp" not in err, err  # not the temp file's name


def test_rows_written_before_their_later_fields_read_back_with_them_empty() -> None:
    old = {"paper": "x", "metric": "m", "paper_ratio": None, "kvtier_ratio": 2, "paper_range": [1, 3]}
    (row,) = reproduction_rows({"rows": [old]}, "rows.json")
    assert row == {**old, "paper_range": (1, 3), "note": "", "within_30_percent": None}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kvtier_ratio": "2"}, r"rows\[0\]: `kvtier_ratio` is '2'; expected float"),
        ({"paper_range": [1]}, r"rows\[0\]: `paper_range` is \[1\]; expected \[low, high\]"),
        ({"within_30_percent": 1}, r"rows\[0\]: `within_30_percent` is 1; expected bool"),
        ({"metric": None}, r"rows\[0\]: `metric` is None; expected str"),
    ],
)
def test_a_bad_row_field_is_named(change: dict[str, object], message: str) -> None:
    row = {"paper": "x", "metric": "m", "paper_ratio": 1.5, "kvtier_ratio": 1.4, **change}
    with pytest.raises(KvtierError, match=message):
        reproduction_rows({"rows": [row]}, "rows.json")


def test_a_run_where_nothing_finishes_writes_strict_json_that_reads_back_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "nothing.yaml"
    config.write_text(NOTHING_FINISHES)
    out = tmp_path / "out" / "run.json"
    out.parent.mkdir()
    assert main(["sim", "run", str(config), "--json", "--out", str(out)]) == 0
    printed, written = strict_loads(capsys.readouterr().out), strict_loads(out.read_text())
    assert printed == written and isinstance(written, dict)
    assert written["requests"] == 0 and written["ttft_s"] == dict.fromkeys(
        ("max", "mean", "p50", "p90", "p99")
    )
    # Read back, the figures are what the run held in memory (NaN), so they print the same.
    result = run_sim(sim_size.source_config(str(config), None, None))
    assert math.isnan(result["ttft_s"]["mean"])
    back = nan_for_null(strict_loads(json_text(result)), SimResult)
    assert isinstance(back, dict)
    assert json.dumps(back, sort_keys=True) == json.dumps(result, sort_keys=True)  # NaN equal to NaN
    assert sim_summary(back) == sim_summary(result)  # type: ignore[arg-type]
    page = write_html(out.parent).read_text()
    assert "Run nothing-finishes" in page and "TTFT s   mean nan  p50 nan  p99 nan" in page
    # A file written before, with Python's NaN literals, still reads, and says the same.
    out.write_text(json.dumps(result))
    assert "NaN" in out.read_text()
    assert html.escape(sim_summary(result)) in write_html(out.parent).read_text()


def test_a_row_whose_kvtier_figure_was_undefined_reads_back_as_nan() -> None:
    row = {"paper": "x", "metric": "m", "paper_ratio": 1.5, "kvtier_ratio": math.nan}
    data = strict_loads(json_text({"rows": [row]}))
    assert data == {"rows": [{**row, "kvtier_ratio": None}]} and isinstance(data, dict)
    (back,) = reproduction_rows(data, "rows.json")
    assert math.isnan(back["kvtier_ratio"]) and back["paper_ratio"] == 1.5
