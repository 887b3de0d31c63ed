"""Reproductions of the five papers' headline experiments (``kvtier sim reproduce``).

Each paper module registers one function with :func:`reproduction`. It runs its experiments from the
YAML files in ``experiments/<paper>/`` (hardware and model numbers come from the shared profiles;
no constant is tuned per experiment), draws a plot in the style of the paper's figure into
``out_dir``, and returns :class:`Row` s: the paper's ratio next to kvtier's, with a note where they
differ and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Required, TypedDict

from kvtier.errors import ConfigError
from kvtier.sim.config import experiments_dir as experiments_dir


class PolicySpec(TypedDict, total=False):
    """A ``policy:`` section as a reproduction sets it (the policy's other keys: the config's)."""

    name: Required[str]
    stages: list[str]  # composed's
    read_paths: str  # DualPath's ablation: "pe" or "dual"
    scheduler: str  # DualPath's inter-engine scheduler
    ttft_slo_s: float  # the experiment's SLOs and B_xfer, for RotaSched and composed
    tbt_slo_s: float
    xfer_blocks: int


class PlaneProfile(TypedDict):
    """The data-plane part of a reproduced system: the ``pool:`` keys it sets (``kvtier.sim.pool.PoolSpec``)."""

    layout: str  # "serial" or "pooled"
    passthrough: bool


class RowJson(TypedDict):
    """:meth:`Row.to_dict`: a row as ``kvtier sim reproduce`` writes it (``rows.json``, ``--json``)."""

    paper: str
    metric: str
    paper_ratio: float | None
    kvtier_ratio: float
    paper_range: tuple[float, float] | None
    note: str
    within_30_percent: bool | None


@dataclass(frozen=True)
class Row:
    paper: str
    metric: str
    paper_ratio: float | None  # None where the paper gives a range: see paper_range
    kvtier_ratio: float
    paper_range: tuple[float, float] | None = None
    note: str = ""

    @property
    def within_30_percent(self) -> bool | None:
        """Whether kvtier's ratio is within ±30% of the paper's (of the range's nearest end)."""
        if self.paper_range is not None:
            lo, hi = self.paper_range
            return lo * 0.7 <= self.kvtier_ratio <= hi * 1.3
        if self.paper_ratio is None:
            return None
        return abs(self.kvtier_ratio - self.paper_ratio) <= 0.3 * abs(self.paper_ratio)

    def to_dict(self) -> RowJson:
        return {
            "paper": self.paper,
            "metric": self.metric,
            "paper_ratio": self.paper_ratio,
            "kvtier_ratio": self.kvtier_ratio,
            "paper_range": self.paper_range,
            "note": self.note,
            "within_30_percent": self.within_30_percent,
        }


Reproduction = Callable[[Path, bool], list[Row]]  # (out_dir, quick) -> rows
_REGISTRY: dict[str, Reproduction] = {}


def reproduction(paper: str) -> Callable[[Reproduction], Reproduction]:
    def register(fn: Reproduction) -> Reproduction:
        if paper in _REGISTRY:
            raise ConfigError(f"reproduction {paper!r} registered twice")
        _REGISTRY[paper] = fn
        return fn

    return register


def papers() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def run(paper: str, out_dir: Path, quick: bool = False) -> list[Row]:
    """Runs one paper's reproduction; ``quick`` shrinks workloads (for tests), never the model."""
    _load_all()
    if paper not in _REGISTRY:
        raise ConfigError(f"unknown paper {paper!r}; expected one of {sorted(_REGISTRY)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return _REGISTRY[paper](out_dir, quick)


def _load_all() -> None:
    """Imports every paper module in this package so they register."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
