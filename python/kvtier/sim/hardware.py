"""Hardware profiles: what one GPU and its share of the host can do, with a source for every number.

A profile is one YAML file in ``profiles/hardware/`` (its stem is its name: ``h100-sxm``, ``h200``,
``gh200``, ``l40s``, ``cpu``) or any YAML file given by path. Every number has its unit in its
name and a citation under ``sources`` keyed by the field (``host_link.h2d_bytes_per_s`` for link
fields): a profile without a source for a number does not load.

Conventions (what the cost model and the links rely on):

- ``gpu_bf16_flops_per_s`` and ``hbm_bytes_per_s`` are datasheet peaks (dense, no sparsity); the
  cost model applies the achievable fraction (MFU, bandwidth efficiency), so both stay comparable
  across GPUs.
- Link bandwidths are *measured* large-transfer rates (e.g. PCIe Gen5 x16 ~50 GB/s, not its 64 GB/s
  line rate; NVLink-C2C ~200 GB/s per direction, SuperInfer §3.3). Small transfers are slower
  because every segment pays ``per_segment_overhead_s`` (the ``cudaMemcpyAsync`` launch, DualPath
  §5.2; Strata Fig. 3; SuperInfer Fig. 5 and Table 1): see :func:`kvtier.sim.cost.transfer_work_s`.
- ``duplex=True``: each direction has its own bandwidth and both run at once. ``duplex=False``: the
  directions share one channel, so concurrent H2D and D2H transfers split its time. Optional
  ``duplex_total_bytes_per_s`` (duplex links only): a memory behind the link that is itself
  half-duplex caps both directions together, so while both are busy each runs at its own rate x
  ``min(1, total / (h2d + d2h))``; a lone direction keeps its full rate (GH200: Grace DRAM,
  SuperInfer §3.3).
- Optional ``per_copy_h2d_bytes_per_s`` / ``per_copy_d2h_bytes_per_s``: the rate of the bytes of
  copies launched one per segment (one ``cudaMemcpyAsync`` each); a batched copy (one launch per
  direction for all segments, ``cudaMemcpyBatchAsync``) moves at ``h2d``/``d2h_bytes_per_s``.
  Absent: the same rate (GH200: SuperInfer Table 1 Naive and MS, §4.3.1).
- Host-side resources (DRAM, SSDs, NICs) are this GPU's share of its node (node total divided by
  ``gpus_per_node``); an engine spanning ``tp`` GPUs owns ``tp`` shares and ``tp`` host links.
- ``nvlink_bytes_per_s`` is the effective GPU-to-GPU bandwidth per direction used by the tensor
  parallel all-reduce; 0 means no NVLink (the cost model then uses the host link, PCIe P2P).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError, did_you_mean

HARDWARE_DIR = Path(__file__).parent / "profiles" / "hardware"


@dataclass(frozen=True)
class LinkSpec:
    """A host link (PCIe, NVLink-C2C, memcpy): measured bandwidth per direction and per-segment cost."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex: bool
    per_segment_overhead_s: float
    kind: str
    duplex_total_bytes_per_s: float = 0.0  # 0: no shared cap (both directions at full rate at once)
    per_copy_h2d_bytes_per_s: float = 0.0  # copies launched one per segment; 0: h2d_bytes_per_s
    per_copy_d2h_bytes_per_s: float = 0.0  # 0: d2h_bytes_per_s

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"link {self.kind!r}: {name} is {value}; expected a positive bandwidth")
        if not (math.isfinite(self.per_segment_overhead_s) and self.per_segment_overhead_s >= 0):
            raise ConfigError(
                f"link {self.kind!r}: per_segment_overhead_s is {self.per_segment_overhead_s}; expected >= 0"
            )
        if not self.kind:
            raise ConfigError("link kind is empty; expected e.g. 'pcie-gen5-x16'")
        total = self.duplex_total_bytes_per_s
        if not (math.isfinite(total) and total >= 0):
            raise ConfigError(f"link {self.kind!r}: duplex_total_bytes_per_s is {total}; expected >= 0")
        if total and not self.duplex:
            raise ConfigError(f"link {self.kind!r}: duplex_total_bytes_per_s on a half-duplex link")
        for name in ("per_copy_h2d_bytes_per_s", "per_copy_d2h_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"link {self.kind!r}: {name} is {value}; expected >= 0 (0: the link's rate)"
                )

    @property
    def concurrent_scale(self) -> float:
        """The factor on each direction's rate while both directions are busy (1: no shared cap)."""
        return concurrent_scale(self.h2d_bytes_per_s, self.d2h_bytes_per_s, self.duplex_total_bytes_per_s)


def concurrent_scale(in_bytes_per_s: float, out_bytes_per_s: float, total_bytes_per_s: float) -> float:
    """``min(1, total / (in + out))``; 1 when ``total`` is 0 (no shared cap)."""
    if total_bytes_per_s <= 0:
        return 1.0
    return min(1.0, total_bytes_per_s / (in_bytes_per_s + out_bytes_per_s))


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU, its HBM, its host link and its share of the node's DRAM, SSDs and NICs."""

    name: str
    gpu_bf16_flops_per_s: float
    hbm_bytes_per_s: float
    hbm_capacity_bytes: int
    host_link: LinkSpec
    dram_capacity_bytes: int
    dram_bytes_per_s: float
    ssd_count: int
    ssd_read_bytes_per_s: float  # each SSD
    ssd_write_bytes_per_s: float  # each SSD
    storage_nic_bytes_per_s: float
    compute_nic_bytes_per_s: float
    nvlink_bytes_per_s: float
    gpus_per_node: int = 1
    sources: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        positive = ("gpu_bf16_flops_per_s", "hbm_bytes_per_s", "hbm_capacity_bytes", "dram_bytes_per_s")
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"hardware {self.name!r}: {name} is {value}; expected > 0")
        non_negative = (
            "dram_capacity_bytes",
            "ssd_count",
            "ssd_read_bytes_per_s",
            "ssd_write_bytes_per_s",
            "storage_nic_bytes_per_s",
            "compute_nic_bytes_per_s",
            "nvlink_bytes_per_s",
        )
        for name in non_negative:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"hardware {self.name!r}: {name} is {value}; expected >= 0")
        if self.ssd_count > 0 and not (self.ssd_read_bytes_per_s > 0 and self.ssd_write_bytes_per_s > 0):
            raise ConfigError(f"hardware {self.name!r}: {self.ssd_count} SSDs with zero bandwidth")
        if self.gpus_per_node < 1:
            raise ConfigError(f"hardware {self.name!r}: gpus_per_node is {self.gpus_per_node}; expected >= 1")


# Fields read from YAML: name -> (type, required). Everything numeric needs a `sources` entry.
_LINK_FIELDS: dict[str, type] = {
    "h2d_bytes_per_s": float,
    "d2h_bytes_per_s": float,
    "duplex": bool,
    "per_segment_overhead_s": float,
    "kind": str,
}
_OPTIONAL_LINK_FIELDS: dict[str, type] = {
    "duplex_total_bytes_per_s": float,
    "per_copy_h2d_bytes_per_s": float,
    "per_copy_d2h_bytes_per_s": float,
}
_PROFILE_FIELDS: dict[str, type] = {
    "name": str,
    "gpus_per_node": int,
    "gpu_bf16_flops_per_s": float,
    "hbm_bytes_per_s": float,
    "hbm_capacity_bytes": int,
    "dram_capacity_bytes": int,
    "dram_bytes_per_s": float,
    "ssd_count": int,
    "ssd_read_bytes_per_s": float,
    "ssd_write_bytes_per_s": float,
    "storage_nic_bytes_per_s": float,
    "compute_nic_bytes_per_s": float,
    "nvlink_bytes_per_s": float,
}
_UNCITED = {"name", "host_link.kind"}


def hardware_names() -> list[str]:
    """Names of the shipped hardware profiles (file stems in ``profiles/hardware``), sorted."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str) -> HardwareProfile:
    """The profile named ``name_or_path`` (case-insensitive), or the one in the YAML file at that path."""
    path, data = load_profile_yaml(name_or_path, HARDWARE_DIR, "hardware", hardware_names())
    return hardware_from_dict(data, str(path))


def hardware_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> HardwareProfile:
    """Build and validate a profile from a parsed YAML mapping; ``source`` names it in errors."""
    known = set(_PROFILE_FIELDS) | {"host_link", "sources"}
    _reject_unknown(data, known, source)
    link_data = data.get("host_link")
    if not isinstance(link_data, Mapping):
        raise ConfigError(f"{source}: field `host_link` is missing or not a mapping")
    _reject_unknown(link_data, set(_LINK_FIELDS) | set(_OPTIONAL_LINK_FIELDS), f"{source} host_link")
    optional = {
        k: _field(link_data, k, t, source, "host_link.")
        for k, t in _OPTIONAL_LINK_FIELDS.items()
        if k in link_data
    }
    link = LinkSpec(
        **{k: _field(link_data, k, t, f"{source}", "host_link.") for k, t in _LINK_FIELDS.items()}, **optional
    )
    values: dict[str, Any] = {}
    for key, kind in _PROFILE_FIELDS.items():
        if key == "gpus_per_node" and key not in data:
            continue
        values[key] = _field(data, key, kind, source, "")
    sources = data.get("sources")
    if not isinstance(sources, Mapping):
        raise ConfigError(f"{source}: field `sources` is missing or not a mapping (cite every number)")
    cited = {str(k): str(v) for k, v in sources.items()}
    needed = [k for k in _PROFILE_FIELDS if k in data] + [
        f"host_link.{k}"
        for k in [*_LINK_FIELDS, *_OPTIONAL_LINK_FIELDS]
        if k in _LINK_FIELDS or k in link_data
    ]
    uncited = [k for k in needed if k not in _UNCITED and not cited.get(k, "").strip()]
    if uncited:
        raise ConfigError(f"{source}: no source cited for {', '.join(uncited)}; add them under `sources`")
    return HardwareProfile(host_link=link, sources=cited, **values)


def load_profile_yaml(
    name_or_path: str, directory: Path, kind: str, names: list[str]
) -> tuple[Path, Mapping[str, Any]]:
    """Resolve a profile name (a file stem in ``directory``) or a YAML path; parse it to a mapping.

    Shared by hardware and model profiles. Raises :class:`ConfigError` listing ``names`` for an
    unknown name, and naming the file when it is missing, unreadable or not a YAML mapping.
    """
    candidate = Path(name_or_path)
    is_path = candidate.suffix in (".yaml", ".yml") or "/" in name_or_path or "\\" in name_or_path
    if is_path:
        path = candidate
        if not path.is_file():
            raise ConfigError(f"{kind} profile file {path} does not exist")
    else:
        path = directory / f"{name_or_path.lower()}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"unknown {kind} profile {name_or_path!r}{did_you_mean([name_or_path.lower()], names)}; "
                f"known: {', '.join(names)}"
            )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{kind} profile {path}: cannot read YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{kind} profile {path}: expected a YAML mapping at top level")
    return path, data


def _reject_unknown(data: Mapping[str, Any], known: set[str], source: str) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(unknown)}{did_you_mean(unknown, known)}; "
            f"known: {', '.join(sorted(known))}"
        )


def _field(data: Mapping[str, Any], key: str, kind: type, source: str, prefix: str) -> Any:
    """``data[key]`` as ``kind``; numbers may be YAML strings such as ``"50e9"`` (YAML 1.1 quirk)."""
    if key not in data or data[key] is None:
        raise ConfigError(f"{source}: required field `{prefix}{key}` is missing")
    raw = data[key]
    where = f"{source}: field `{prefix}{key}` is {raw!r}"
    if kind is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{where}; expected a string")
        return raw
    if kind is bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"{where}; expected true or false")
        return raw
    value = as_number(raw, where)
    if kind is int:
        if isinstance(raw, int):
            return raw
        if value != int(value):
            raise ConfigError(f"{where}; expected an integer")
        return int(value)
    return value


def as_number(raw: object, where: str) -> float:
    """A finite, non-negative number from an int, float or numeric string; ``where`` prefixes errors."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ConfigError(f"{where}; expected a number")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{where}; expected a number") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}; expected a finite number >= 0")
    return value
