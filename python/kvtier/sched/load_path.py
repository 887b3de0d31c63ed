"""How a load's KV crosses the host link into the device: data-plane configuration, not policy (issue
18 step 4).

A policy decides what to load, when and in which order (a :class:`~kvtier.sched.base.LoadOrder`'s
tokens, mode, priority, target); :class:`LoadPath` describes the copies that carry it, which the
engine reads from its config (the sim config's ``load`` section, :func:`load_path`; where it names no
``engine``, the path the policy's paper ran on, :mod:`kvtier.sched.data_plane`). A policy that weighs
a load's time asks the engine (``SchedulerView.cost.load_s``), which prices it on this path.

The paths the reproductions use (:data:`LOAD_ENGINES`):

- ``plain``: whole objects per copy (a block of all layers; one layer of a block for a layerwise
  load). LMCache's 256-token chunk objects (Strata §5.1), Unified KV pooling, DualPath.
- ``per_page``: one ``cudaMemcpyAsync`` per page, per layer, K and V separately (SGLang-HiCache's
  32-token pages, Strata §3.1 and §5.1): small segments reach ~22% of PCIe 5.0 bandwidth (Fig. 3).
  A DMA: no compute slowdown.
- ``gpu_kernel``: Strata's GPU-assisted gather/scatter kernels over a page-first host layout (§4.2):
  a layerwise load moves each layer's K and V of the request in one kernel (a segment of the loaded
  tokens), any other load whole page-first objects. The kernels run on two CUDA blocks and slow
  concurrent compute by < 5% for prefill and ~10% for decode (Fig. 5): ``layerwise_interference``
  0.05 (it runs beside the prefill), ``interference`` 0.10 (an asynchronous load runs beside decode
  batches).

A prefetch into host memory (``target=Tier.HOST``) does not cross the host link: no path applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import LoadMode
from kvtier.sched.section import profile, profile_section

COPIES = ("object", "page", "kernel")
HICACHE_PAGE_TOKENS = 32  # Strata §5.1: SGLang-HiCache's page size (per-page cudaMemcpyAsync)
PREFILL_INTERFERENCE = 0.05  # Strata Fig. 5: < 5% prefill slowdown with two 1024-thread I/O blocks
DECODE_INTERFERENCE = 0.10  # Strata Fig. 5: 10% decode slowdown with the same quota


@dataclass(frozen=True, slots=True)
class LoadPath:
    """The copies a load to the device is made of, and how much they slow the model's compute.

    ``copy``: ``object`` (whole objects), ``page`` (``page_tokens`` of one layer's K or V per copy),
    ``kernel`` (a layerwise load: one copy per layer of all its tokens; else whole objects).
    ``layerwise_interference`` / ``interference``: the fractional compute slowdown while a layerwise
    load / any other load runs.
    """

    copy: str = "object"
    page_tokens: int = HICACHE_PAGE_TOKENS
    interference: float = 0.0
    layerwise_interference: float = 0.0

    def __post_init__(self) -> None:
        if self.copy not in COPIES:
            raise ConfigError(f"load `copy` is {self.copy!r}; expected one of {list(COPIES)}")
        if (
            isinstance(self.page_tokens, bool)
            or not isinstance(self.page_tokens, int)
            or self.page_tokens < 1
        ):
            raise ConfigError(f"load `page_tokens` is {self.page_tokens!r}; expected an int >= 1")
        for name in ("interference", "layerwise_interference"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(f"load `{name}` is {value!r}; expected a number >= 0")

    def segment_tokens(self, mode: LoadMode, tokens: int) -> int | None:
        """Tokens of one layer per copy of a load of ``tokens`` in ``mode``; None: whole objects (a
        block of all layers, or one layer of a block when layerwise)."""
        if self.copy == "page":
            return self.page_tokens
        if self.copy == "kernel" and mode is LoadMode.LAYERWISE:
            return max(tokens, 1)
        return None

    def slowdown(self, mode: LoadMode) -> float:
        """Fractional slowdown of model compute while a load in ``mode`` runs."""
        return self.layerwise_interference if mode is LoadMode.LAYERWISE else self.interference


#: The engine's plain path (the defaults).
PLAIN_LOAD = LoadPath()

LOAD_ENGINES: dict[str, LoadPath] = {
    "plain": PLAIN_LOAD,
    "per_page": LoadPath(copy="page"),
    "gpu_kernel": LoadPath(
        copy="kernel", interference=DECODE_INTERFERENCE, layerwise_interference=PREFILL_INTERFERENCE
    ),
}
#: The keys of a ``load`` section besides ``engine``: :class:`LoadPath`'s fields.
LOAD_KEYS = tuple(f.name for f in fields(LoadPath))


def load_engine(name: str) -> LoadPath:
    """The :class:`LoadPath` named ``name`` in :data:`LOAD_ENGINES`; unknown names raise."""
    return profile("load", LOAD_ENGINES, name)


def load_path(section: Mapping[str, Any] | None, default: str) -> LoadPath:
    """The sim config's ``load`` section as a :class:`LoadPath`: ``{engine: NAME, KEY: VALUE...}``,
    the named path with the given keys (:data:`LOAD_KEYS`) changed; ``None`` or no ``engine``: the
    path named ``default``."""
    return profile_section("load", section, LOAD_ENGINES, LOAD_KEYS, default, "{engine: per_page}")
