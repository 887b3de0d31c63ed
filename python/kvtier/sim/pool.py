"""The KV store below the device as separate devices: host-memory modules and SSDs, each with its
own bandwidth and queue (Unified KV pooling §III-A, §IV). Built when a run's config has a ``pool``
section; without one the engine keeps its plain tiers (one host link, striped SSDs).

```yaml
pool:
  dram_modules: 2                        # the hardware's DRAM bandwidth split over equal modules
  filesystem_object_overhead_s: 4.19e-3  # kernel-filesystem time per object (one cache block)
  layout: pooled                         # serial (default) | pooled
  passthrough: true                      # SSD access skips the filesystem (default false)
  placement: bandwidth_aware             # how a pooled transfer is split (the only one)
```

The layout and the SSD access path are data-plane mechanism, set here, not by the scheduling
policy: a paper's system is (policy, this section), and its ablations are differences of it.
Two layouts (``layout``, with ``passthrough``):

- ``serial`` (LMCache, §III-B): the host tier sits behind ONE memory module and the SSD tier on ONE
  SSD ("the current version of LMCache uses a single set of host-memory module and SSD"); SSD blocks
  are staged through that module on their way to the GPU. The other modules and SSDs stay idle.
- ``pooled`` (unified KV pooling, §IV-A): one logical tier whose capacity is the host and SSD
  capacities together; every transfer is split over all devices by ``placement`` (the
  bandwidth-aware allocator, Algorithm 1) in items of one layer of one block, and the parts run in
  parallel (:class:`~kvtier.sim.resources.WeightedStripedLink`). The pool is the engine's HOST tier
  (reported as host hits). The GLT is not materialised: a load's per-device counts are
  Algorithm 1's counts of the loaded items, which is what the GLT would return for a load of one
  whole offload set (§IV-C2), and per-device capacity is not tracked (the pool's is the sum).

Through the filesystem an SSD pays ``filesystem_object_overhead_s`` per cache block (one LMCache
chunk file) in each direction; KV-passthrough (SPDK, §IV-B) pays nothing beyond the device time.

``layout`` and ``passthrough`` left out are filled by a deprecated policy name that used to carry
them (``unified_pool``, ...; :func:`kvtier.sim.config.resolve_deprecated`), else serial / false.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.unified_pool import bandwidth_aware_counts
from kvtier.sim.core import EventLoop
from kvtier.sim.hardware import HardwareProfile, as_number
from kvtier.sim.resources import Link, StripedLink, WeightedStripedLink

LAYOUTS = ("serial", "pooled")
#: How a pooled transfer's items are split over the devices, by name (``pool.placement``).
PLACEMENTS: dict[str, Callable[[int, Sequence[float]], list[int]]] = {
    "bandwidth_aware": bandwidth_aware_counts,  # Unified KV pooling Algorithm 1
}


@dataclass(frozen=True)
class PoolSpec:
    dram_modules: int = 1
    filesystem_object_overhead_s: float = 0.0
    layout: str = "serial"
    passthrough: bool = False
    placement: str = "bandwidth_aware"

    def __post_init__(self) -> None:
        if (
            isinstance(self.dram_modules, bool)
            or not isinstance(self.dram_modules, int)
            or self.dram_modules < 1
        ):
            raise ConfigError(f"pool `dram_modules` is {self.dram_modules!r}; expected an int >= 1")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"pool `layout` is {self.layout!r}; expected one of {list(LAYOUTS)}")
        if not isinstance(self.passthrough, bool):
            raise ConfigError(f"pool `passthrough` is {self.passthrough!r}; expected true or false")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"pool `placement` is {self.placement!r}; expected one of {list(PLACEMENTS)}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> PoolSpec:
        if not isinstance(data, Mapping):
            raise ConfigError(f"sim `pool` is {data!r}; expected a mapping")
        known = {"dram_modules", "filesystem_object_overhead_s", "layout", "passthrough", "placement"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown pool key(s) {unknown}; expected some of {sorted(known)}")
        overhead = as_number(
            data.get("filesystem_object_overhead_s", 0.0), "pool `filesystem_object_overhead_s`"
        )
        return cls(
            int(data.get("dram_modules", 1)),
            overhead,
            str(data.get("layout", "serial")),
            data.get("passthrough", False),
            str(data.get("placement", "bandwidth_aware")),
        )


@dataclass
class PoolLinks:
    """What the engine gets: the device(s) behind its host tier, its SSD tier's device (serial
    layout only), the two tiers' capacities in blocks, and every device (for link statistics)."""

    host_store: Link | StripedLink
    ssd: Link | None
    host_blocks: int
    ssd_blocks: int
    devices: list[Link]


def build_pool(
    spec: PoolSpec,
    hw: HardwareProfile,
    loop: EventLoop,
    block_bytes: int,
    num_layers: int,
    host_blocks: int,
    ssd_blocks: int,
    tp: int = 1,
) -> PoolLinks:
    """The pool's devices and the engine's view of them, in ``spec``'s layout. An engine of ``tp``
    GPUs moves all its GPUs' bytes (``block_bytes``) over ``tp`` GPUs' shares of each device (the
    profile's figures are one GPU's): each device ``tp`` times one GPU's share, side by side."""
    module_bw = hw.dram_bytes_per_s * tp / spec.dram_modules
    # DRAM reads and writes share the module's channel: half duplex, like an SSD.
    modules = [Link(loop, f"dram{i}", module_bw, module_bw, duplex=False) for i in range(spec.dram_modules)]
    fs_s = 0.0 if spec.passthrough else spec.filesystem_object_overhead_s
    ssds = [
        Link(
            loop,
            f"ssd{i}",
            hw.ssd_read_bytes_per_s * tp,
            hw.ssd_write_bytes_per_s * tp,
            duplex=False,
            per_segment_overhead_s=fs_s,
        )
        for i in range(hw.ssd_count)
    ]
    if ssd_blocks > 0 and not ssds:
        raise ConfigError(f"`ssd_capacity_bytes` is set but hardware {hw.name!r} has no SSDs")
    if spec.layout == "serial":
        return PoolLinks(
            modules[0], ssds[0] if ssd_blocks > 0 else None, host_blocks, ssd_blocks, modules + ssds
        )
    devices = modules + (ssds if ssd_blocks > 0 else [])
    bandwidths = tuple(d.bandwidth_bytes_per_s[0] for d in devices)

    place = PLACEMENTS[spec.placement]

    def split(num_items: int) -> list[int]:
        return place(num_items, bandwidths)

    item_bytes = max(1, block_bytes // num_layers)
    pooled = WeightedStripedLink("pool", devices, split, item_bytes)
    return PoolLinks(pooled, None, host_blocks + ssd_blocks, 0, devices)
