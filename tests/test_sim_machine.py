"""A calibration knows where it was fitted (issue 22 item 1): `kvtier sim calibrate` records the
machine, and loading or validating a calibration fitted on another kind of machine says so and
names the command that refits it here."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.sim.calibrate import QUICK_SHAPES, Sample, report, write
from kvtier.sim.cost import COEFFICIENTS, BatchShape, PrefillChunk, load_calibration, read_calibration
from kvtier.sim.machine import COMPARED, REFIT, differences, fingerprint
from kvtier.sim.validate import Turn, compare


def test_the_fingerprint_names_cpu_cores_vector_units_and_blas() -> None:
    here = fingerprint()
    assert set(COMPARED) <= set(here)
    assert here["cpu_model"] and here["cpu_model"] != "unknown"
    assert isinstance(here["cores"], int) and here["cores"] >= 1
    assert isinstance(here["avx512f"], bool) and here["blas"]
    assert differences(here) == []


@pytest.mark.parametrize("field", COMPARED)
def test_every_compared_field_that_differs_is_named(field: str) -> None:
    other = {**fingerprint(), field: "something else"}
    [difference] = differences(other)
    assert difference.startswith(f"{field}: 'something else' there")


def test_a_calibration_without_a_machine_is_flagged() -> None:
    assert differences(None) == [
        "the calibration records no machine (fitted before kvtier recorded machines)"
    ]
    assert differences({}) == differences(None)


def _fitted(tmp_path: Path, name: str, machine: dict[str, object] | None) -> str:
    shapes = [BatchShape((PrefillChunk(n, c),), ()) for n in (16, 32, 64, 128) for c in (0, 256)] + [
        BatchShape((), (64 * k,) * k) for k in (1, 2, 3, 4, 6, 8)
    ]
    samples = [Sample(s, 0.01 + 0.001 * i + 0.0003 * i * i) for i, s in enumerate(shapes)]
    grid = [Sample(s, 0.02) for s in shapes[: len(QUICK_SHAPES)]]
    result = report(samples, grid, kv_bytes_per_token=1024, num_layers=30, model="m", blas_threads=1)
    assert result["machine"] == fingerprint()  # a fit records where it ran
    if machine is None:
        del result["machine"]
    else:
        result["machine"] = machine
    path = tmp_path / name
    write(result, path)
    return str(path)


def test_loading_a_calibration_from_elsewhere_warns_once_with_the_refit_command(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    here = _fitted(tmp_path, "here.yaml", fingerprint())
    there = _fitted(tmp_path, "there.yaml", {**fingerprint(), "cores": 512})
    with caplog.at_level(logging.WARNING, logger="kvtier.sim"):
        assert set(load_calibration(here)) == set(COEFFICIENTS)
        assert caplog.records == []
        load_calibration(there)
        load_calibration(there)
    [warning] = caplog.records
    assert "there.yaml" in warning.getMessage() and "cores: 512 there" in warning.getMessage()
    assert REFIT in warning.getMessage()
    assert read_calibration(there)["machine"]["cores"] == 512


def test_validation_reports_whether_its_calibration_was_fitted_here(tmp_path: Path) -> None:
    turns = [Turn(0, None, [1] * 32, [2] * 4, 4, ttft_s=0.5, tpot_s=0.05)]
    sim = {"ttft_s": {"mean": 0.6}, "tpot_s": {"mean": 0.05}, "requests": 1}
    here = compare([turns], sim, _fitted(tmp_path, "here.yaml", fingerprint()))
    assert here["calibration_fitted_here"] and here["calibration_machine_differences"] == []
    assert here["sim_ttft_error"] == pytest.approx(0.2)
    unrecorded = compare(
        [turns], sim, _fitted(tmp_path, "none.yaml", None)
    )  # fitted before machines were recorded
    assert not unrecorded["calibration_fitted_here"]
    assert "records no machine" in unrecorded["calibration_machine_differences"][0]


def test_an_engine_runtime_is_recorded_and_compared_only_where_both_sides_know_it() -> None:
    """vLLM's torch (version, threads) joins the fingerprint from its worker's report; a machine
    that did not run vLLM (no torch fields here) does not call the calibration foreign for it."""
    worker = {"torch": "2.13.0", "torch_threads": 2, "steps": []}
    recorded = fingerprint(worker)
    assert (recorded["torch"], recorded["torch_threads"]) == ("2.13.0", 2) and "steps" not in recorded
    assert differences(recorded) == []  # here: no torch known, only the machine is compared
    assert differences(recorded, fingerprint(worker)) == []
    [threads] = differences(recorded, fingerprint({**worker, "torch_threads": 1}))
    assert threads == "torch_threads: 2 there, 1 here"
    [version] = differences(recorded, fingerprint({**worker, "torch": "2.9.0"}))
    assert version.startswith("torch: '2.13.0' there")
