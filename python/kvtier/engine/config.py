"""The reference engine's sizes and cost figures (:class:`EngineConfig`), validated at construction.

Its own module so that the engine loop (:mod:`kvtier.engine.scheduler`), the view it shows its
policy (:mod:`kvtier.engine.view`) and the tools that drive the engine all import it from below
them, and none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine.errors import EngineInputError
from kvtier.sched.data_plane import OFFLOAD_MODES
from kvtier.sched.swap_copy import SWAP_ENGINES


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine loop (and whether it keeps a device prefix cache). ``swap_blocks``: host blocks for swapped-out requests (0: none, a
    swap-out falls back to recompute). The ``*_per_s`` figures are the cost estimates shown to the
    policy (rough CPU figures, see docs/engine.md)."""

    block_tokens: int = 16
    num_blocks: int = 256
    max_batch_tokens: int = 256
    max_running: int = 16
    swap_blocks: int = 256
    view_waiting_max: int = 64
    prefill_tokens_per_s: float = 350.0
    host_load_bytes_per_s: float = 4e9
    ssd_load_bytes_per_s: float = 1e9
    remote_load_bytes_per_s: float = 1e8
    # False: a finished request's blocks leave the device at once (vLLM with prefix caching off),
    # so every later hit comes from the store. As the simulator's EngineConfig.device_prefix_cache.
    device_prefix_cache: bool = True
    # True: a prefix hit's load runs while the step computes, each layer's attention waiting for
    # that layer's blocks (KvTransfer.load_async; the transfer engine's wait_layer). A block that
    # fails to load voids that request's step, which is recomputed from the failed block.
    layerwise_loads: bool = False
    # True: SuperInfer's eager block rotation (§4.3.2). Each step, running requests' newly full
    # blocks are copied to free host slots in the background while the step computes; they stay
    # synced (KV is append-only), so a later swap-out moves only the blocks written since.
    eager_rotation: bool = False
    # The swap path the policy counts a swap-out's freed blocks by (a name in
    # kvtier.sched.swap_copy.SWAP_ENGINES; the engine's own swaps are synchronous, docs/engine.md).
    # None: the one the policy was evaluated on (kvtier.sched.data_plane).
    swap_engine: str | None = None
    # What the engine keeps below the device (a name in kvtier.sched.data_plane.OFFLOAD_MODES; as the
    # simulator's `offload.mode`): `write_through` also saves each prompt's blocks once prefilled;
    # any mode but `none` needs a store. None: its policy's paper's (kvtier.sched.data_plane).
    offload: str | None = None

    def __post_init__(self) -> None:
        if self.offload is not None and self.offload not in OFFLOAD_MODES:
            raise EngineInputError(
                f"engine `offload` is {self.offload!r}; expected one of {list(OFFLOAD_MODES)}"
            )
        if self.swap_engine is not None and self.swap_engine not in SWAP_ENGINES:
            raise EngineInputError(
                f"engine `swap_engine` is {self.swap_engine!r}; expected one of {sorted(SWAP_ENGINES)}"
            )
        for name in ("device_prefix_cache", "layerwise_loads", "eager_rotation"):
            if not isinstance(getattr(self, name), bool):
                raise EngineInputError(f"engine `{name}` is {getattr(self, name)!r}; expected True or False")
        for name in ("block_tokens", "num_blocks", "max_batch_tokens", "max_running", "view_waiting_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineInputError(f"engine `{name}` is {value!r}; expected an int >= 1")
        if (
            isinstance(self.swap_blocks, bool)
            or not isinstance(self.swap_blocks, int)
            or self.swap_blocks < 0
        ):
            raise EngineInputError(f"engine `swap_blocks` is {self.swap_blocks!r}; expected an int >= 0")
        for name in (
            "prefill_tokens_per_s",
            "host_load_bytes_per_s",
            "ssd_load_bytes_per_s",
            "remote_load_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise EngineInputError(f"engine `{name}` is {getattr(self, name)!r}; expected > 0")
