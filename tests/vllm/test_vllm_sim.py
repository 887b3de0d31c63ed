"""The simulator against real vLLM (issue 22 item 3): a small calibration from vLLM's own steps,
then the held-out chat workload on vLLM (its prefix cache; kvtier's DRAM and SSD tiers through
the connector) and in the simulator. Structure and agreement of shapes, never wall-clock bounds."""

from __future__ import annotations

import math
from pathlib import Path

from vllm_harness import VENV

from kvtier.bench import vllm_sim
from kvtier.sim.calibrate import write
from kvtier.sim.cost import COEFFICIENTS, CONNECTOR_COEFFICIENTS, read_calibration


def test_calibrate_on_vllm_steps_then_validate_with_and_without_kvtier_hits(tmp_path: Path) -> None:
    result = vllm_sim.calibrate(VENV, quick=True, progress=False)
    assert result["engine"]["name"].startswith("vllm")
    assert result["machine"]["cores"] >= 1 and result["engine_steps"] >= len(COEFFICIENTS)
    # The machine includes vLLM's torch, as its worker reported it (kvtier never imported torch).
    assert result["machine"]["torch"] == result["engine"]["torch"] and result["machine"]["torch_threads"] >= 1
    # The same workload timed again with kvtier's connector: its increments, measured and >= 0.
    connector = result["connector"]
    assert connector["engine_steps"] == result["engine_steps"] and connector["config"]["dram"]
    assert all(connector[k] >= 0 for k in CONNECTOR_COEFFICIENTS)
    assert math.isfinite(connector["held_out_mean_rel_error"])
    assert all(result[k] >= 0 for k in COEFFICIENTS) and any(result[k] > 0 for k in COEFFICIENTS)
    assert math.isfinite(result["held_out_mean_rel_error"])
    cal = tmp_path / "vllm.yaml"
    write(result, cal)
    assert read_calibration(str(cal))["engine"]["block_tokens"] == 128

    out = vllm_sim.validate(
        VENV,
        str(cal),
        repeats=1,
        conversations=2,
        turns=2,
        reply_tokens=4,
        doc_tokens=(300, 140),
        progress=False,
    )
    prefix, dram, ssd = (out["cases"][c] for c in ("vllm_prefix_cache", "kvtier_dram", "kvtier_ssd"))
    for row in (prefix, dram, ssd):
        assert row["requests"] == row["sim_requests"] == 4
        assert row["calibration_fitted_here"]
        for key in ("sim_ttft_error", "sim_tpot_error", "step_mean_abs_error"):
            assert math.isfinite(row[key]) and row[key] >= 0
        assert row["engine_mean_ttft_s"] > 0 and row["sim_mean_ttft_s"] > 0
        # The second turns' histories (316 + 4 + 24 and 156 + 4 + 24 tokens) hit their first two
        # and first block of 128 tokens: in vLLM's own cache, or loaded from kvtier's DRAM or SSD.
        assert row["cached_tokens"] == 3 * 128
    # vLLM's cache: the simulator computed the same prefill chunks and decode batches as vLLM.
    assert prefix["sim_steps_match_engine"]
    assert prefix["sim_hit_rate_tokens"]["device"] > 0
    # kvtier: the simulator loaded the hits from its host tier, vLLM's connector from DRAM.
    assert dram["kvtier_stats"]["loads"] >= 2
    assert dram["sim_hit_rate_tokens"]["host"] > 0
    # kvtier's SSD tier (DRAM holds two blocks): real loads read SSD, simulated ones too.
    assert ssd["kvtier_ssd_loaded_blocks"] >= 1 and ssd["sim_hit_rate_tokens"]["ssd"] > 0
    assert ssd["kvtier_stats"]["store"]["written_through"] >= 3
