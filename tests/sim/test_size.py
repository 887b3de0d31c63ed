"""`kvtier sim size`: the smallest colocated cluster that serves a trace within a TTFT SLO."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.sim.config import SimConfig
from kvtier.sim.run import run
from kvtier.sim.size import size, trace_config
from kvtier.sim.workload.mooncake import default_trace_path

SLO_S = 2.0


def small(**changes: object) -> SimConfig:
    """150 requests of the bundled Mooncake trace at its own rate: more than one H100 serves."""
    config = SimConfig(
        name="size-test",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": "fcfs"},
        block_tokens=512,
        workload={"name": "mooncake", "max_requests": 150},
    )
    return config.with_overrides(**changes) if changes else config


def test_the_answer_passes_one_engine_fewer_fails_and_the_rows_are_real_runs() -> None:
    result = size(small(), SLO_S, attainment=0.8).as_dict()  # as --json prints it
    n = result["engines"]
    assert n is not None and n >= 2
    rows = {r["engines"]: r for r in result["runs"]}
    assert rows[n]["passes"] and not rows[n - 1]["passes"]  # bisection tried both neighbours
    assert all(
        r["passes"] == (r["ttft_attainment"] >= 0.8 and r["unfinished_requests"] == 0) for r in rows.values()
    )
    assert min(e for e, r in rows.items() if r["passes"]) == n
    # The reported figures are those of a plain run at that size (not the search's own bookkeeping).
    again = run(small(engines=n - 1, slo={"ttft_s": SLO_S}))
    assert again["slo"]["ttft_attainment"] == rows[n - 1]["ttft_attainment"] < 0.8
    assert again["ttft_s"]["p99"] == rows[n - 1]["ttft_p99_s"]


def test_a_limit_too_small_reports_no_cluster() -> None:
    result = size(small(), SLO_S, attainment=0.8, max_engines=2)
    assert result.engines is None
    assert [r.engines for r in result.runs] == [1, 2]
    assert not any(r.passes for r in result.runs)
    out = json.loads(json.dumps(result.as_dict()))
    assert set(out) == {"engines", "ttft_slo_s", "attainment", "runs"} and out["engines"] is None
    assert set(out["runs"][0]) == {
        "engines", "passes", "ttft_attainment", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "requests",
        "unfinished_requests", "wall_s",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("config", "kwargs", "match"),
    [
        (small(prefill_engines=1, decode_engines=1), {}, "P/D groups"),
        (small(), {"ttft_slo_s": 0.0}, "TTFT SLO"),
        (small(), {"ttft_slo_s": float("nan")}, "TTFT SLO"),
        (small(), {"attainment": 1.5}, "attainment"),
        (small(), {"max_engines": 0}, "max engines"),
    ],
)
def test_bad_input_is_a_config_error_naming_it(
    config: SimConfig, kwargs: dict[str, float], match: str
) -> None:
    args: dict[str, object] = {"ttft_slo_s": SLO_S, **kwargs}
    with pytest.raises(ConfigError, match=match):
        size(config, **args)  # type: ignore[arg-type]


def test_a_trace_must_be_a_known_format_that_exists(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"expected a Mooncake-format \.jsonl or an Azure \.csv"):
        trace_config(tmp_path / "trace.txt")
    with pytest.raises(ConfigError, match="does not exist"):
        trace_config(tmp_path / "missing.jsonl")


def test_cli_sizes_a_trace_file(tmp_path: Path) -> None:
    trace = tmp_path / "first150.jsonl"
    lines = Path(default_trace_path()).read_text().splitlines()[:150]
    trace.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "sim", "size", str(trace), "--policy", "fcfs",
         "--ttft-slo", str(SLO_S), "--attainment", "0.8", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["engines"] == size(trace_config(trace, "fcfs"), SLO_S, attainment=0.8).engines >= 2
