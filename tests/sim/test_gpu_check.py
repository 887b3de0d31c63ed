"""kvtier.sim.gpu_check: the simulator's GPU constants against steps and copies measured on a real
H200 and H100 (tests/fixtures/gpu/, recorded by scripts/gpu_calibrate.py and scripts/gpu_links.cu)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.results import json_text, to_json
from kvtier.sim import gpu_check, gpu_measurement
from kvtier.sim.cost import RooflineCostModel
from kvtier.sim.hardware import load_hardware
from kvtier.sim.models import load_model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpu"
H200 = FIXTURES / "h200-2026-11-27.json"
H100 = FIXTURES / "h100-2026-11-27.json"


def raw(path: Path = H200) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def data(path: Path = H200) -> gpu_measurement.Measurement:
    return gpu_measurement.read(path)


@functools.cache
def checked(path: Path = H200) -> gpu_check.GpuCheck:
    """``gpu_check.check`` of a fixture, once per run (its roofline fit takes seconds)."""
    return gpu_check.check(data(path))


def test_link_fit_recovers_the_constants_it_was_made_from() -> None:
    rate, overhead = 48e9, 3.5e-6
    rows = [
        (seg * n, n, seg * n / rate + n * overhead)
        for seg, n in ((4096, 16384), (65536, 4096), (1 << 22, 256))
    ]
    fit = gpu_check.fit_link(rows, "h2d")
    assert fit.bytes_per_s == pytest.approx(rate, rel=1e-9)
    assert fit.per_segment_overhead_s == pytest.approx(overhead, rel=1e-9)
    assert fit.max_rel_error < 1e-9


def test_link_fit_needs_two_rows_and_positive_times() -> None:
    with pytest.raises(ConfigError, match="need 2 or more"):
        gpu_check.fit_link([(4096, 1, 1e-6)], "d2h")
    with pytest.raises(ConfigError, match="positive times"):
        gpu_check.fit_link([(4096, 1, 1e-6), (8192, 1, 0.0)], "d2h")


@pytest.mark.parametrize("path", [H200, H100])
def test_cpp_copies_fit_the_simulators_link_form(path: Path) -> None:
    """The measured per-segment cudaMemcpyAsync times fit transfer_work_s's bytes/rate + segments x
    overhead, and the fitted overhead lies inside what each row implies at the fitted rate."""
    links = checked(path).links
    rows = data(path).links_cpp
    assert links is not None and rows is not None
    for d, fit in (("h2d", links.cpp_h2d), ("d2h", links.cpp_d2h)):
        assert fit is not None
        assert fit.fit_max_rel_error < 0.2
        implied = [
            (r.seconds - r.bytes / fit.bytes_per_s) / r.segments
            for r in rows
            if r.direction == d and r.method == "memcpy_async_per_segment"
        ]
        assert min(implied) <= fit.per_segment_overhead_s <= max(implied)
        # GPU-assisted I/O (one gather kernel) is not slowed by small pages (Strata §4):
        assert fit.gather_kernel_bytes_per_s_min > 0.9 * fit.gather_kernel_bytes_per_s_max


def test_roofline_rows_are_the_simulators_own_predictions() -> None:
    steps, measured_steps = checked().steps, data().steps
    assert steps is not None and measured_steps is not None
    model = RooflineCostModel(load_hardware("h200"), load_model("llama-3.1-8b"))
    rows = measured_steps.rows
    assert len(steps.rows) == len(rows) == 30
    for row, measured in zip(steps.rows, rows, strict=True):
        assert row.roofline_s == model.step_time_s(measured.shape)
        assert row.measured_s == measured.seconds


@pytest.mark.parametrize("path", [H200, H100])
def test_fitting_the_roofline_constants_lowers_its_error(path: Path) -> None:
    steps = checked(path).steps
    assert steps is not None
    assert steps.roofline_fitted_mean_abs_rel_error < 0.8 * steps.roofline_default_mean_abs_rel_error
    assert set(steps.roofline_fitted) == set(gpu_check.ROOFLINE_CONSTANTS)


def test_repeat_measurement_gives_the_noise_floor() -> None:
    steps = checked().steps
    assert (
        steps is not None and steps.repeat_mean_rel_diff is not None and steps.repeat_max_rel_diff is not None
    )
    assert 0 < steps.repeat_mean_rel_diff <= steps.repeat_max_rel_diff < 0.1
    assert checked(H100).steps is not None
    assert "repeat_mean_rel_diff" not in to_json(checked(H100).steps)  # no steps_repeat there


@pytest.mark.parametrize(
    ("gpu", "profile"),
    [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA GH200 480GB", "GH200")],
)
def test_hardware_profile_from_the_gpu_name(gpu: str, profile: str) -> None:
    assert gpu_check.hardware_for(gpu).name == profile


def test_unknown_gpu_asks_for_a_profile() -> None:
    with pytest.raises(ConfigError, match="--hardware"):
        gpu_check.hardware_for("NVIDIA A10")


def test_bad_measurements_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        gpu_measurement.read(path)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not a readable JSON"):
        gpu_measurement.read(path)
    path.write_text(json.dumps({"steps": {}}))
    with pytest.raises(ConfigError, match="`machine` is missing"):
        gpu_measurement.read(path)
    bad = raw()
    bad["steps"]["rows"][3]["graph_s"] = -1.0
    with pytest.raises(ConfigError, match=r"steps.rows\[3\]: `graph_s` is -1.0; expected a positive"):
        gpu_measurement.parse(bad)
    tiny = raw()
    tiny["steps"]["model"] = "tiny"
    with pytest.raises(ConfigError, match=r"Llama-3\.1-8B-shaped"):
        gpu_check.check(gpu_measurement.parse(tiny))


@pytest.mark.parametrize(
    ("part", "key", "value", "message"),
    [
        ("links", "bytes", "64 MiB", r"links.rows\[2\]: `bytes` is .*; expected int"),
        ("links", "one_copy_s", "fast", r"links.rows\[2\]: `one_copy_s` is .*; expected float"),
        ("links_cpp", "method", None, r"links_cpp.rows\[2\]: `method` is missing"),
        ("steps", "prefills", [[1, 2, 3]], r"steps.rows\[2\]: `prefills`\[0\] is \[1, 2, 3\]"),
        ("steps", "decodes", [-4], r"steps.rows\[2\]: `decodes`\[0\] is -4"),
        ("steps_repeat", "graph_s", float("inf"), r"steps_repeat.rows\[2\]: `graph_s` is inf"),
    ],
)
def test_a_bad_field_in_a_row_is_named(part: str, key: str, value: object, message: str) -> None:
    bad = raw()
    if value is None:
        del bad[part]["rows"][2][key]
    else:
        bad[part]["rows"][2][key] = value
    with pytest.raises(ConfigError, match=message):
        gpu_measurement.parse(bad)


def test_bad_overlap_and_kvtier_parts_are_named() -> None:
    bad = raw(H100)
    bad["overlap"]["rows"][0]["step_alone_s"] = 0
    with pytest.raises(ConfigError, match=r"overlap.rows\[0\]: `step_alone_s` is 0.0; expected a positive"):
        gpu_measurement.parse(bad)
    bad = raw(H100)
    bad["kvtier"]["threads_8"] = {"put_s": 1.0}
    with pytest.raises(ConfigError, match="kvtier: threads_8: `load_s` is missing"):
        gpu_measurement.parse(bad)
    bad = raw(H100)
    bad["machine"]["gpu"] = 7
    with pytest.raises(ConfigError, match="machine: `gpu` is 7"):
        gpu_measurement.parse(bad)


def test_the_json_report_keeps_its_keys_and_echoes_the_measurement() -> None:
    for path in (H200, H100):
        out = json.loads(json_text(checked(path)))  # as --json prints it
        measured = raw(path)
        assert out["machine"] == measured["machine"] and out["kvtier"] == measured["kvtier"]
        assert list(out) == [
            "machine",
            "hardware_profile",
            "steps",
            "links",
            *(["overlap"] if path == H100 else []),
            "kvtier",
        ]
        assert list(out["links"]) == [
            "profile",
            "python_h2d",
            "python_d2h",
            "duplex_bytes_per_s",
            "cpp_h2d",
            "cpp_d2h",
        ]
        assert list(out["steps"]["rows"][0]) == ["shape", "measured_s", "roofline_s", "fitted_roofline_s"]


def test_cli_prints_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([str(H100)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100" in out and "cudaMemcpyAsync per segment" in out and "roofline default" in out
    assert gpu_check.main([str(H200), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware_profile"] == "H200"


def test_dma_copies_beside_a_step_are_reported_per_shape_and_direction() -> None:
    rows, measured = checked(H100).overlap, data(H100).overlap
    assert rows is not None and measured is not None
    assert [r.direction for r in rows] == [r.direction for r in measured] == ["h2d", "d2h", "both"] * 3
    for row, r in zip(rows, measured, strict=True):
        assert row.step_slowdown == r.step_together_s / r.step_alone_s
    # The recorded H100 run: a step with a copy stream in flight ran within 5% of the step alone.
    assert max(r.step_slowdown for r in rows) < 1.05
