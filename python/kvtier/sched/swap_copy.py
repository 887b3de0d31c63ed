"""How an engine copies swapped KV over the host link: data-plane configuration, not policy (issue 18
step 4).

:class:`SwapCopy` describes the copy path (SuperInfer §4.3, Table 1); :data:`SWAP_ENGINES` names the
paths the reproductions use. The simulator's config chooses one (``swap: {engine: duplexkv}``,
:func:`swap_copy`); where it names none, the one the policy's paper ran on
(:mod:`kvtier.sched.data_plane`). A policy reads the engine's path from its view
(``SchedulerView.swap_copy``), e.g. to count the blocks a swap-out frees this very step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.section import checked_section, profile


@dataclass(frozen=True, slots=True)
class SwapCopy:
    """How the engine copies a swapped request's KV over the host link (SuperInfer §4.3, Table 1).

    The defaults are the engine's plain swap: one copy per block, both directions at once, all
    blocks moved at swap-out and freed when the copy lands, no step ever waits for a swap.

    ``sync``: ``"none"`` (swaps are independent transfers); ``"step"`` (vLLM: a step's swaps run
    before its forward pass, so its compute waits for them and swapped-out blocks are reusable at
    once); ``"next_step"`` (cross-iteration pipeline, §4.3.2 Fig. 15: a step's swaps overlap its
    compute and the next step starts once both are done). Under ``step``/``next_step`` a step's
    swaps leave as one copy per direction.
    """

    layer_first: bool = False  # one copy per layer per block (PagedAttention's segment, §4.3.1)
    batched: bool = False  # one copy launch per direction per step (cudaMemcpyBatchAsync, §4.3.2 "MK")
    duplex: bool = True  # False: copies run one at a time, FIFO (HBM block data race, Fig. 13)
    eager: bool = False  # eager block rotation: full blocks copied out in the background (§4.3.2)
    sync: str = "none"  # none | step | next_step

    def __post_init__(self) -> None:
        if self.sync not in ("none", "step", "next_step"):
            raise ConfigError(f"SwapCopy sync is {self.sync!r}; expected none, step or next_step")

    def segment_bytes(self, nbytes: int, block_bytes: int, num_layers: int) -> int:
        """Bytes per copy launch of a ``nbytes`` swap (§4.3.1): the whole swap (batched), one layer
        of a block (layer-first paged KV: 64 KB for Qwen2.5-32B), or one block (4 MB)."""
        if self.batched:
            return max(nbytes, 1)
        if self.layer_first:
            return max(1, block_bytes // num_layers)
        return block_bytes


#: The engine's plain swap (the defaults).
PLAIN_SWAP = SwapCopy()

# The engine's plain swap, and Table 1's transfer engines (§5.3 "How much bandwidth can DuplexKV
# achieve?") inside SuperInfer's cross-iteration pipeline (§5.3's "w/o DuplexKV" keeps the overlap:
# "slow transfers ... preventing full overlap"), plus vLLM's own swap path for the §3.1 baselines.
SWAP_ENGINES: dict[str, SwapCopy] = {
    "plain": PLAIN_SWAP,
    # vLLM's swap: 64 KB per-layer copies, directions serial, run before the forward pass (§3.1).
    "vllm": SwapCopy(layer_first=True, batched=False, duplex=False, eager=False, sync="step"),
    # Naive: a cudaMemcpyAsync per 64 KB layer segment (layer-first paged KV, §4.3.1).
    "naive": SwapCopy(layer_first=True, batched=False, duplex=False, eager=False, sync="next_step"),
    # MS: block-first layout merges a block's layers into one 4 MB copy, still one launch each.
    "ms": SwapCopy(layer_first=False, batched=False, duplex=False, eager=False, sync="next_step"),
    # MS+MK: one cudaMemcpyBatchAsync launch per direction; data races still serialise directions.
    "ms_mk": SwapCopy(layer_first=False, batched=True, duplex=False, eager=False, sync="next_step"),
    # DuplexKV: MS+MK + eager block rotation, so both directions run at once without data races.
    "duplexkv": SwapCopy(layer_first=False, batched=True, duplex=True, eager=True, sync="next_step"),
}
TABLE1_LADDER = ("naive", "ms", "ms_mk", "duplexkv")


def swap_engine(name: str) -> SwapCopy:
    """The :class:`SwapCopy` named ``name`` in :data:`SWAP_ENGINES`; unknown names raise."""
    return profile("swap", SWAP_ENGINES, name)


def swap_copy(section: Mapping[str, Any] | None, default: str) -> SwapCopy:
    """The sim config's ``swap`` section as a :class:`SwapCopy`: ``{engine: NAME}``; ``None`` or no
    ``engine``: the engine named ``default`` (:func:`kvtier.sched.data_plane.default_engine`)."""
    if section is None:
        return swap_engine(default)
    section = checked_section("swap", section, ("engine",), "{engine: duplexkv}")
    return profile("swap", SWAP_ENGINES, section.get("engine", default))
