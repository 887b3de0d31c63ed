"""Issue 22 item 2: the fitted cost model predicts a held-out *workload*. Its one-token-step term
(the reference engine's one-row products run as GEMV) is recovered from samples of known
coefficients, old and bad calibration files are handled, the validation reports the engine's own
noise floor, and the model's step error on a workload with prefix hits is the simulator's: the
simulator computes the engine's batch shapes, hits included."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.sim.calibrate import Sample, fit, relative_errors, write
from kvtier.sim.cost import COEFFICIENTS, BatchShape, FittedCostModel, PrefillChunk, load_calibration
from kvtier.sim.validate import Turn, compare, step_errors

# About this machine's SmolLM2 steps: a one-token step ~35 ms, two tokens ~70 ms.
TRUE = FittedCostModel(
    1024, 30, base_s=0.03, token_s=0.0024, pair_s=1.1e-6, seq_s=0.001, decode_pair_s=1e-5, multi_token_s=0.05
)
# The calibration workload's kinds of step: prefills of many sizes and contexts, decodes of one to
# sixteen sequences, mixed steps.
SHAPES = (
    [BatchShape((PrefillChunk(n, c),)) for n in (17, 64, 250) for c in (0, 131, 600)]
    + [BatchShape((), (ctx,) * k) for k in (1, 2, 4, 7, 16) for ctx in (90, 300)]
    + [BatchShape((PrefillChunk(40, 0), PrefillChunk(12, 48)), (200,) * 3)]
)


def test_fit_recovers_the_one_token_step() -> None:
    samples = [Sample(s, TRUE.step_time_s(s)) for s in SHAPES]
    fitted = fit(samples, 1024, 30)
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    # Without the term, one line cannot pass through both one- and few-token steps.
    no_term = FittedCostModel(1024, 30, **{k: getattr(TRUE, k) for k in COEFFICIENTS if k != "multi_token_s"})
    assert max(relative_errors(no_term, samples)) > 0.3


def test_a_calibration_from_before_the_term_loads_with_it_at_zero(tmp_path: Path) -> None:
    old = {k: getattr(TRUE, k) for k in COEFFICIENTS if k != "multi_token_s"}
    path = tmp_path / "old.yaml"
    write({"kind": "fitted", **old}, path)
    assert load_calibration(str(path)) == {**old, "multi_token_s": 0.0}
    assert "multi_token_s" in load_calibration("cpu-smollm2-135m")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("- 1\n- 2\n", "not a mapping"),
        (
            yaml.safe_dump({k: 0.01 for k in COEFFICIENTS} | {"multi_token_s": -0.1}),
            "negative \\['multi_token_s'\\]",
        ),
        (yaml.safe_dump({k: 0.01 for k in COEFFICIENTS if k != "seq_s"}), "lacks numeric \\['seq_s'\\]"),
    ],
)
def test_bad_calibration_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_calibration(str(path))


def _calibration(tmp_path: Path) -> str:
    path = tmp_path / "cal.yaml"
    write({"kind": "fitted", **{k: getattr(TRUE, k) for k in COEFFICIENTS}}, path)
    return str(path)


def test_compare_reports_the_mean_of_runs_and_their_spread(tmp_path: Path) -> None:
    def run(ttft: float, tpot: float) -> list[Turn]:
        return [Turn(0, None, [1] * 32, [2] * 4, 4, ttft, tpot), Turn(1, 0, [1] * 40, [2] * 4, 4, ttft, tpot)]

    runs = [run(0.30, 0.10), run(0.33, 0.10), run(0.27, 0.11)]
    sim = {"ttft_s": {"mean": 0.33}, "tpot_s": {"mean": 0.1}, "requests": 2}
    r = compare(runs, sim, _calibration(tmp_path))
    assert r["engine_runs"] == 3 and r["requests"] == 2
    assert r["engine_mean_ttft_s"] == pytest.approx(0.30)
    assert r["sim_ttft_error"] == pytest.approx(0.1)
    assert r["engine_ttft_noise"] == pytest.approx(0.06 / 0.30)
    assert r["engine_tpot_noise"] == pytest.approx(0.01 / (0.31 / 3))
    assert compare(runs[:1], sim, _calibration(tmp_path))["engine_ttft_noise"] == 0.0
    with pytest.raises(ConfigError, match="at least one engine run"):
        compare([], sim, _calibration(tmp_path))


def test_step_errors_are_the_models_on_the_engines_steps(tmp_path: Path) -> None:
    steps = [Sample(s, TRUE.step_time_s(s) * 1.25) for s in SHAPES]
    sim_steps = [
        BatchShape(tuple(reversed(s.prefills)), tuple(reversed(s.decode_context_tokens))) for s in SHAPES
    ]
    r = step_errors(_calibration(tmp_path), steps, sim_steps)
    assert r["engine_steps"] == r["sim_steps"] == len(SHAPES)
    assert r["sim_steps_match_engine"]  # the order of sequences within a step does not matter
    assert r["step_mean_error"] == pytest.approx(-0.2) and r["step_mean_abs_error"] == pytest.approx(0.2)
    assert not step_errors(_calibration(tmp_path), steps, sim_steps[1:])["sim_steps_match_engine"]


def test_the_model_error_on_prefix_hits_is_the_simulators(smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from threadpoolctl import threadpool_limits

    from kvtier.engine.config import EngineConfig
    from kvtier.engine.validate import run_engine
    from kvtier.sim.validate import simulate

    model, tokenizer = smollm2
    config = EngineConfig(num_blocks=128, max_batch_tokens=64, max_running=4)
    engine_steps: list[Sample] = []
    with threadpool_limits(limits=1, user_api="blas"):
        turns = run_engine(
            model,
            tokenizer,
            conversations=2,
            turns=3,
            reply_tokens=3,
            engine_config=config,
            step_log=engine_steps,
        )
    sim_steps: list[BatchShape] = []
    result = simulate(turns, config, _calibration(tmp_path), step_shapes=sim_steps)
    # Later turns prefill after their cached history (chunks with context on both sides).
    assert result["hit_rate_tokens"]["device"] > 0
    assert any(c.context_tokens >= 16 for s in engine_steps for c in s.shape.prefills)
    r = step_errors(_calibration(tmp_path), engine_steps, sim_steps)
    assert r["sim_steps_match_engine"], (
        [s.shape for s in engine_steps],
        sim_steps,
    )
    expected = [(TRUE.step_time_s(s.shape) - s.seconds) / s.seconds for s in engine_steps]
    assert r["step_mean_error"] == pytest.approx(sum(expected) / len(expected))


def test_a_turn_sent_the_moment_its_parent_finishes_joins_the_next_step(tmp_path: Path) -> None:
    from kvtier.engine.config import EngineConfig
    from kvtier.sim.calibrate import canonical
    from kvtier.sim.validate import simulate

    a = Turn(0, None, [1] * 32, [2, 3], 2, 0.0, 0.0)
    b = Turn(1, None, [5] * 32, [6] * 5, 5, 0.0, 0.0)
    follow = Turn(2, 0, a.prompt + a.output + [7] * 14, [8, 9], 2, 0.0, 0.0)
    shapes: list[BatchShape] = []
    config = EngineConfig(num_blocks=64, max_batch_tokens=256, max_running=16)
    simulate([a, b, follow], config, _calibration(tmp_path), step_shapes=shapes)
    # Step 2's decode finishes a; as in the engine's loop, the next step prefills its follow-up
    # (after the 32 tokens a left cached) beside b's decode, not one step later.
    assert [canonical(s) for s in shapes[:3]] == [
        (((32, 0), (32, 0)), ()),
        ((), (33, 33)),
        (((16, 32),), (34,)),
    ]
