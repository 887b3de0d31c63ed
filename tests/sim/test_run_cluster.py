"""`kvtier sim run --engines N` (the config's `engines`, behind its router) and the replay's
streaming: arrivals pulled lazily, finished requests folded into the metrics as they finish."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.errors import ConfigError
from kvtier.sim.config import SimConfig
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.request import Request
from kvtier.sim.run import build, run, workload
from kvtier.sim.size import source_config
from kvtier.sim.workload.mooncake import default_trace_path


def small(requests: int = 120, **changes: object) -> SimConfig:
    """The bundled Mooncake trace's first requests at its own rate on H100s (more than one serves)."""
    config = SimConfig(
        name="cluster-test",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": "fcfs"},
        block_tokens=512,
        workload={"name": "mooncake", "max_requests": requests},
    )
    return config.with_overrides(**changes) if changes else config


@pytest.mark.parametrize("router", ["round_robin", "least_loaded", "prefix_aware"])
def test_engines_spread_the_requests_and_finish_every_one(router: str) -> None:
    one = run(small(router=router))
    three = run(small(engines=3, router=router))
    assert three["cluster"] == {
        "engines": 3,
        "prefill_engines": 0,
        "decode_engines": 0,
        "router": router,
        "requests_per_engine": three["cluster"]["requests_per_engine"],
    }
    placed = three["cluster"]["requests_per_engine"]
    assert len(placed) == 3 and sum(placed) == 120 and min(placed) > 0
    assert three["requests"] == one["requests"] == 120
    assert three["unfinished_requests"] == one["unfinished_requests"] == 0
    assert one["cluster"]["requests_per_engine"] == [120]
    assert three["ttft_s"]["mean"] < one["ttft_s"]["mean"]  # three engines queue less than one


def test_cli_engines_on_a_trace_and_on_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = default_trace_path().read_text().splitlines()[:60]
    trace.write_text("\n".join(lines) + "\n")
    assert cli.main(["sim", "run", str(trace), "--engines", "2", "--policy", "fcfs", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["engines"] == 2 and sum(result["cluster"]["requests_per_engine"]) == 60
    assert result["requests"] == 60 and result["unfinished_requests"] == 0
    assert result["policy"] == {"name": "fcfs"} and result["peak_rss_bytes"] > 2**20
    config = tmp_path / "sim.yaml"
    config.write_text(
        "name: tiny\nhardware: h100-sxm\nmodel: llama-3.1-8b\npolicy: {name: fcfs}\nblock_tokens: 512\n"
        f"engines: 3\nrouter: round_robin\nworkload: {{name: mooncake, path: {trace}}}\n"
    )
    assert cli.main(["sim", "run", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["requests_per_engine"] == [20, 20, 20]
    assert cli.main(["sim", "run", str(config), "--engines", "2"]) == 0
    assert "cluster 2 engines behind round_robin, requests per engine 30-30" in capsys.readouterr().out


def test_bad_engine_counts_are_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text("policy: fcfs\nworkload: {name: longdoc}\n")
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["sim", "run", str(config), "--engines", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--engines" in err and bad.lstrip("-") in err
    with pytest.raises(ConfigError, match=r"--engines is 0"):
        source_config(str(config), engines=0)
    with pytest.raises(ConfigError, match=r"`engines` is 0"):
        small(engines=0)
    pd = tmp_path / "pd.yaml"
    pd.write_text("policy: fcfs\nprefill_engines: 1\ndecode_engines: 1\nworkload: {name: longdoc}\n")
    assert cli.main(["sim", "run", str(pd), "--engines", "4"]) == 2
    assert "--engines 4" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"`engines` is 2 with P/D groups"):
        small(engines=2, prefill_engines=1, decode_engines=1)
    assert cli.main(["sim", "run", str(config), "--policy", "hicache"]) == 2
    assert "--policy 'hicache' applies to a trace" in capsys.readouterr().err


def test_streaming_gives_the_metrics_of_the_whole_trace_held_and_folded_at_the_end() -> None:
    config = small(150, engines=2, slo={"ttft_s": 5.0, "tpot_s": 0.1})
    streamed = run(config)
    # Non-streaming: the whole trace in memory before the replay, every finished request's record
    # kept, and the metrics folded from the kept records after the replay.
    held = list(workload(config))
    sim = build(config)
    records: list[RequestRecord] = []
    fold = sim.metrics.add_request
    sim.metrics.add_request = records.append  # type: ignore[method-assign]
    pulled: list[int] = []

    def counting(requests: list[Request]) -> Iterator[Request]:
        for req in requests:
            pulled.append(req.req_id)
            yield req

    sim.cluster.feed(counting(held))
    assert pulled == [0]  # lazily: one request ahead, not the trace
    sim.loop.run(until_s=config.max_sim_s)
    assert len(records) == len(held) == 150
    for record in records:
        fold(record)
    again = {k: v for k, v in sim.metrics.result({}).items() if k != "links"}
    assert again == {k: v for k, v in streamed.items() if k in again and k != "links"}
    assert set(again) <= set(streamed)


def test_peak_rss_is_reported_by_run_and_the_bench(tmp_path: Path) -> None:
    result = run(small(20))
    assert 2**20 < result["peak_rss_bytes"] < 2**40 and result["cpu_s"] > 0
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "sim", "--scaling", "--copies", "1,2"]
    args = ["--policies", "fcfs", "--engines", "1,2", "--max-requests", "30", "--json"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [(r["copies"], r["engines"]) for r in out["rows"]] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert all(2**20 < r["peak_rss_bytes"] <= out["peak_rss_bytes"] for r in out["rows"])
    assert all(r["events_per_cpu_s"] > 0 and r["unfinished_requests"] == 0 for r in out["rows"])
    assert set(out["scaling_exponent"]["fcfs"]) == {"1", "2"}
