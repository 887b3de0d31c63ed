"""``kvtier sim calibrate``: the fitted step-time model, its fit, its files and the real measurement
(:mod:`kvtier.sim.calibrate` fits, :mod:`kvtier.engine.calibrate` and :mod:`kvtier.engine.validate` measure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.sim.calibrate import QUICK_SHAPES, Sample, fit, relative_errors, report, summary, write
from kvtier.sim.cost import (
    COEFFICIENTS,
    BatchShape,
    FittedCostModel,
    PrefillChunk,
    load_calibration,
    make_cost_model,
)
from kvtier.sim.hardware import load_hardware
from kvtier.sim.models import load_model

TRUE = FittedCostModel(
    1024, 30, base_s=0.02, token_s=0.002, pair_s=3e-6, seq_s=0.004, decode_pair_s=1e-6, multi_token_s=0.03
)


def test_features_and_step_time() -> None:
    batch = BatchShape((PrefillChunk(4, 10),), (7, 9))
    assert FittedCostModel.features(batch) == (1.0, 6.0, 4 * 10 + 4 * 5 / 2, 3.0, 7.0 + 9.0, 1.0)
    expected = 0.02 + 0.002 * 6 + 3e-6 * 50 + 0.004 * 3 + 1e-6 * 16 + 0.03
    assert TRUE.step_time_s(batch) == pytest.approx(expected)
    assert TRUE.step_time_s(BatchShape()) == 0.0
    assert TRUE.prefill_time_s(8, 0) == pytest.approx(0.02 + 0.016 + 3e-6 * 36 + 0.004 + 0.03)
    # A one-token step (one decode, or a one-token prefill) has no multi-token cost.
    one = BatchShape((), (99,))
    assert FittedCostModel.features(one)[-1] == 0.0
    assert TRUE.step_time_s(one) == pytest.approx(0.02 + 0.002 + 0.004 + 1e-6 * 99)


def test_fit_recovers_known_coefficients() -> None:
    samples = [Sample(shape, TRUE.step_time_s(shape)) for shape in QUICK_SHAPES]
    fitted = fit(samples, 1024, 30)
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert max(relative_errors(fitted, samples)) < 1e-9


def test_report_holds_out_every_other_step_and_predicts_the_grid() -> None:
    # An odd count of shapes, so that both halves hold every kind of step (one-token ones included).
    shapes = (*QUICK_SHAPES, BatchShape((), (80,)))
    samples = [Sample(shape, TRUE.step_time_s(shape)) for shape in shapes * 2]
    grid = [Sample(QUICK_SHAPES[0], 2 * TRUE.step_time_s(QUICK_SHAPES[0]))]
    r = report(samples, grid, kv_bytes_per_token=1024, num_layers=30, model="m", blas_threads=1)
    assert r["kind"] == "fitted" and r["engine_steps"] == len(samples)
    for name in COEFFICIENTS:
        assert r[name] == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert r["held_out_max_rel_error"] < 1e-9 and r["fit_mean_rel_error"] < 1e-9
    [row] = r["forward_grid"]
    assert row["predicted_s"] == pytest.approx(row["measured_s"] / 2)
    assert "held-out steps" in summary(r)


def test_fit_keeps_coefficients_non_negative() -> None:
    # Times that fall with more tokens would need a negative token_s: the fit refuses it.
    samples = [Sample(BatchShape((PrefillChunk(n, 0),)), 1.0 / n) for n in (8, 16, 32, 64, 128, 256)]
    fitted = fit(samples, 1024, 30)
    assert all(getattr(fitted, name) >= 0 for name in COEFFICIENTS)


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(ConfigError, match="cannot fit"):
        fit([Sample(QUICK_SHAPES[0], 0.1)], 1024, 30)
    with pytest.raises(ConfigError, match="positive time"):
        fit([Sample(s, 0.0) for s in QUICK_SHAPES], 1024, 30)


def test_calibration_file_round_trip_and_cost_model(tmp_path: Path) -> None:
    path = tmp_path / "cal.yaml"
    write({"kind": "fitted", **{k: getattr(TRUE, k) for k in COEFFICIENTS}}, path)
    assert load_calibration(str(path)) == {k: getattr(TRUE, k) for k in COEFFICIENTS}
    hw, model = load_hardware("cpu"), load_model("smollm2-135m")
    cost = make_cost_model("fitted", hw, model, calibration=str(path))
    batch = BatchShape((PrefillChunk(64, 128),), (300,))
    assert cost.step_time_s(batch) == pytest.approx(TRUE.step_time_s(batch))
    with pytest.raises(ConfigError, match="tp is 2"):
        make_cost_model("fitted", hw, model, tp=2, calibration=str(path))


def test_calibration_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a file nor one of"):
        load_calibration(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"base_s": 0.1, "token_s": "fast"}))
    with pytest.raises(ConfigError, match="lacks numeric"):
        load_calibration(str(bad))


def test_packaged_calibration_drives_a_simulation() -> None:
    hw, model = load_hardware("cpu"), load_model("smollm2-135m")
    cost = make_cost_model("fitted", hw, model, calibration="cpu-smollm2-135m")
    assert cost.prefill_time_s(512) > cost.prefill_time_s(64) > cost.step_time_s(BatchShape((), (64,))) > 0


def test_measures_the_real_engine() -> None:
    from threadpoolctl import threadpool_limits

    from kvtier.engine.calibrate import measure_engine_steps
    from kvtier.engine.model import load_model as load_engine

    engine = load_engine()
    shapes = [BatchShape((PrefillChunk(16, 0),)), BatchShape((PrefillChunk(8, 16),), (20, 33))]
    with threadpool_limits(limits=1, user_api="blas"):
        samples = measure_engine_steps(engine, shapes, repeats=1)
    assert [s.shape for s in samples] == shapes
    assert all(s.seconds > 0 for s in samples)
    with pytest.raises(ConfigError, match="repeats"):
        measure_engine_steps(engine, shapes, repeats=0)


@pytest.fixture(scope="module")
def engine_parts(smollm2):  # type: ignore[no-untyped-def]
    return smollm2


def test_engine_run_samples_log_every_kind_of_step(engine_parts) -> None:  # type: ignore[no-untyped-def]
    from threadpoolctl import threadpool_limits

    from kvtier.engine.calibrate import engine_run_samples

    model, _ = engine_parts
    with threadpool_limits(limits=1, user_api="blas"):
        samples = engine_run_samples(model, quick=True)
    assert all(s.seconds > 0 and not s.shape.is_empty for s in samples)
    assert any(s.shape.prefills and not s.shape.decode_context_tokens for s in samples)
    assert any(s.shape.decode_context_tokens and not s.shape.prefills for s in samples)
    # Decode contexts grow by one token per step of a request.
    assert max(max(s.shape.decode_context_tokens, default=0) for s in samples) > 16


def test_validation_replays_the_engine_workload_in_the_simulator(engine_parts) -> None:  # type: ignore[no-untyped-def]
    from threadpoolctl import threadpool_limits

    from kvtier.engine.config import EngineConfig
    from kvtier.engine.validate import run_engine
    from kvtier.sim.validate import _block_keys, simulate

    model, tokenizer = engine_parts
    config = EngineConfig(num_blocks=128, max_batch_tokens=64, max_running=4)
    with threadpool_limits(limits=1, user_api="blas"):
        turns = run_engine(model, tokenizer, conversations=2, turns=2, reply_tokens=3, engine_config=config)
    assert len(turns) == 4 and all(t.output_tokens == 3 and t.ttft_s > 0 for t in turns)
    by_id = {t.req_id: t for t in turns}
    children = [t for t in turns if t.parent_id is not None]
    assert len(children) == 2
    for child in children:
        parent = by_id[child.parent_id]  # type: ignore[index]
        assert child.prompt[: len(parent.prompt)] == parent.prompt
        full = len(parent.prompt) // 16
        assert (
            _block_keys(child.prompt, 16, child.req_id)[:full]
            == _block_keys(parent.prompt, 16, parent.req_id)[:full]
        )
        assert (
            _block_keys(child.prompt, 16, child.req_id)[-1]
            != _block_keys(parent.prompt, 16, parent.req_id)[-1]
        )
    result = simulate(turns, config, "cpu-smollm2-135m")
    assert result["requests"] == 4
    assert result["ttft_s"]["mean"] > 0 and result["tpot_s"]["mean"] > 0
    # The second turns reuse their conversation's first prompt from the device prefix cache.
    assert result["hit_rate_tokens"]["device"] > 0
