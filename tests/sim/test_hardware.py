"""Hardware profiles: every shipped profile loads with a source per number; bad files are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.sim.hardware import HARDWARE_DIR, LinkSpec, hardware_names, load_hardware

SHIPPED = ["cpu", "gh200", "h100-sxm", "h200", "l40s"]


def test_names_are_the_shipped_files() -> None:
    assert hardware_names() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_profile_loads_with_sane_numbers(name: str) -> None:
    hw = load_hardware(name)
    assert hw.gpu_bf16_flops_per_s > 1e11
    assert hw.hbm_bytes_per_s > 1e10
    assert hw.hbm_capacity_bytes >= 2**33
    assert hw.host_link.h2d_bytes_per_s > 1e9 and hw.host_link.d2h_bytes_per_s > 1e9
    assert hw.dram_capacity_bytes > 0 and hw.dram_bytes_per_s > 0
    assert hw.ssd_count >= 1 and hw.ssd_read_bytes_per_s > 0
    # Every number is cited, host-link fields under dotted keys.
    assert "gpu_bf16_flops_per_s" in hw.sources and "host_link.per_segment_overhead_s" in hw.sources


def test_known_values() -> None:
    h100, gh200, l40s = load_hardware("h100-sxm"), load_hardware("GH200"), load_hardware("l40s")
    assert h100.gpu_bf16_flops_per_s == pytest.approx(989.4e12)
    assert h100.host_link.kind == "pcie-gen5-x16" and h100.host_link.duplex
    assert 45e9 <= h100.host_link.h2d_bytes_per_s <= 55e9  # measured ~50 GB/s, not the 64 GB/s line rate
    assert gh200.host_link.kind == "nvlink-c2c"
    # SuperInfer Table 1 MS+MK (one direction alone); both at once share Grace DRAM's 384 GB/s (§3.3)
    assert gh200.host_link.h2d_bytes_per_s == pytest.approx(269.69e9)
    assert gh200.host_link.d2h_bytes_per_s == pytest.approx(238.95e9)
    assert gh200.host_link.duplex_total_bytes_per_s == pytest.approx(384e9)
    concurrent = gh200.host_link.d2h_bytes_per_s * gh200.host_link.concurrent_scale
    assert concurrent == pytest.approx(180e9, rel=0.01)  # Table 1 DuplexKV: 181 GB/s D2H
    assert h100.host_link.concurrent_scale == 1.0
    # Table 1 Naive and MS: a copy launched one per segment moves at 90 / 164 GB/s, not 239 / 270
    assert gh200.host_link.per_copy_d2h_bytes_per_s == pytest.approx(90.0e9)
    assert gh200.host_link.per_copy_h2d_bytes_per_s == pytest.approx(163.7e9)
    assert h100.host_link.per_copy_h2d_bytes_per_s == 0.0  # absent: copies at the link's rate
    assert gh200.host_link.h2d_bytes_per_s > 3 * h100.host_link.h2d_bytes_per_s
    assert l40s.nvlink_bytes_per_s == 0
    assert not load_hardware("cpu").host_link.duplex


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown hardware profile 'a100'.*h100-sxm.*l40s"):
        load_hardware("a100")


def _write(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _shipped(name: str) -> dict[str, object]:
    data = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_load_by_path(tmp_path: Path) -> None:
    data = _shipped("h200")
    data["name"] = "my-h200"
    assert load_hardware(str(_write(tmp_path, data))).name == "my-h200"


def test_missing_field_names_field_and_file(tmp_path: Path) -> None:
    data = _shipped("h100-sxm")
    del data["hbm_bytes_per_s"]
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=r"custom\.yaml.*`hbm_bytes_per_s` is missing"):
        load_hardware(str(path))


def test_missing_link_field_is_named(tmp_path: Path) -> None:
    data = _shipped("h100-sxm")
    link = data["host_link"]
    assert isinstance(link, dict)
    del link["duplex"]
    with pytest.raises(ConfigError, match=r"`host_link\.duplex` is missing"):
        load_hardware(str(_write(tmp_path, data)))


def test_uncited_number_is_rejected(tmp_path: Path) -> None:
    data = _shipped("l40s")
    sources = data["sources"]
    assert isinstance(sources, dict)
    del sources["dram_bytes_per_s"]
    with pytest.raises(ConfigError, match="no source cited for dram_bytes_per_s"):
        load_hardware(str(_write(tmp_path, data)))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("hbm_bytes_per_s", "fast", "expected a number"),
        ("hbm_bytes_per_s", -1.0, "expected a finite number >= 0"),
        ("ssd_count", 1.5, "expected an integer"),
        ("gpu_bf16_flops_per_s", 0, "expected > 0"),
        ("hbm_typo_bytes", 1, "unknown field"),
    ],
)
def test_bad_values_are_rejected(tmp_path: Path, key: str, value: object, message: str) -> None:
    data = _shipped("h100-sxm")
    data[key] = value
    with pytest.raises(ConfigError, match=message):
        load_hardware(str(_write(tmp_path, data)))


def test_numeric_strings_are_accepted(tmp_path: Path) -> None:
    data = _shipped("h100-sxm")
    data["hbm_bytes_per_s"] = "3.35e12"  # YAML 1.1 reads 3.35e12 as a string
    assert load_hardware(str(_write(tmp_path, data))).hbm_bytes_per_s == 3.35e12


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_hardware(str(tmp_path / "nope.yaml"))


def test_link_spec_validates() -> None:
    with pytest.raises(ConfigError, match="h2d_bytes_per_s"):
        LinkSpec(0.0, 1e9, True, 0.0, "pcie")
    with pytest.raises(ConfigError, match="per_segment_overhead_s"):
        LinkSpec(1e9, 1e9, True, -1.0, "pcie")
    with pytest.raises(ConfigError, match="duplex_total_bytes_per_s"):
        LinkSpec(1e9, 1e9, True, 0.0, "c2c", duplex_total_bytes_per_s=-1.0)
    with pytest.raises(ConfigError, match="half-duplex"):
        LinkSpec(1e9, 1e9, False, 0.0, "ssd", duplex_total_bytes_per_s=1e9)
    with pytest.raises(ConfigError, match="per_copy_d2h_bytes_per_s"):
        LinkSpec(1e9, 1e9, True, 0.0, "c2c", per_copy_d2h_bytes_per_s=float("inf"))


def test_duplex_total_needs_a_source(tmp_path: Path) -> None:
    data = _shipped("gh200")
    sources = data["sources"]
    assert isinstance(sources, dict)
    del sources["host_link.duplex_total_bytes_per_s"]
    with pytest.raises(ConfigError, match=r"no source cited for host_link\.duplex_total_bytes_per_s"):
        load_hardware(str(_write(tmp_path, data)))
