"""How a P/D cluster's prefill engines take in hit KV: data-plane configuration, not policy (issue 18
step 4; DualPath §2.1, §7.2, §7.5).

:class:`KvIo` is the sim config's ``io`` section, read by the node-group cluster
(:mod:`kvtier.sim.dualpath`): ``layerwise`` (layerwise prefill: hit KV streams into per-layer
buffers while the layers compute, so a batch's KV need not fit the GPU at once; off: the batch's
whole KV sits in HBM, loaded before compute) and ``bypass`` (the paper's *Oracle*: every disk read,
H2D/D2H and P/D KV transfer takes no time, the zero-I/O bound). Where a config names no ``engine``,
the one the policy's paper ran (:mod:`kvtier.sched.data_plane`): ``dualpath_basic`` on ``blocking``,
``dualpath_oracle`` on ``oracle``, else ``plain`` (layerwise, real I/O). A policy reads whether its
engine streams layers from its view (``SchedulerView.layerwise_prefill``) to size its batch; the
§7.5 ablation (Basic → +Layerwise → +Dual-Path → DualPath) is config differences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.section import profile_section


@dataclass(frozen=True, slots=True)
class KvIo:
    """Layerwise prefill and the Oracle's bypass of every KV transfer (see the module docs)."""

    layerwise: bool = True
    bypass: bool = False

    def __post_init__(self) -> None:
        for name in ("layerwise", "bypass"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"io `{name}` is {getattr(self, name)!r}; expected true or false")


#: DualPath's own data plane (the defaults).
PLAIN_IO = KvIo()

IO_ENGINES: dict[str, KvIo] = {
    "plain": PLAIN_IO,
    # Basic (§7.2): no layerwise prefill, the batch's whole KV in HBM before compute.
    "blocking": KvIo(layerwise=False),
    # Oracle (§7.2): DualPath with every KV transfer bypassed.
    "oracle": KvIo(bypass=True),
}
#: The keys of an ``io`` section besides ``engine``: :class:`KvIo`'s fields.
IO_KEYS = tuple(f.name for f in fields(KvIo))


def kv_io(section: Mapping[str, Any] | None, default: str) -> KvIo:
    """The sim config's ``io`` section as a :class:`KvIo`: ``{engine: NAME, KEY: VALUE...}``, the
    named profile (:data:`IO_ENGINES`) with the given keys changed; ``None`` or no ``engine``: the
    profile named ``default``."""
    return profile_section("io", section, IO_ENGINES, IO_KEYS, default, "{layerwise: false}")
