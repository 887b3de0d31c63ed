"""RotaSched's transfer budget B_xfer on a simulated node (SuperInfer §4.2.3, §5.1).

§5.1 rotates at most 2400 blocks of 16 Qwen2.5-32B tokens per iteration over the GH200's C2C link,
both ways at once (DuplexKV), a budget sized so that an iteration's swaps hide behind its compute
(the cross-iteration pipeline, Fig. 15). A count of blocks does not carry to another node: at
512-token blocks 2400 blocks are 1.2M tokens (~160 GB of Llama-3.1-8B KV) per iteration. Two
translations, computed from the shared profiles, not fitted:

- time-equal: the blocks this node's host link moves, both ways at once, in the time C2C moves
  §5.1's bytes (the pipeline's view: what one iteration can hide). On §5.1's own node it is 2400.
- token-equal: the same 38,400 tokens in this node's blocks
  (:func:`~kvtier.sched.rotasched.paper_xfer_blocks`, what a policy built outside the simulator takes).

A sim config whose rotating policy (``rotasched``, ``composed``) leaves ``xfer_blocks`` out gets the
time-equal budget (:func:`with_xfer_budget`); one that sets it keeps its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.sched.base import policy_class
from kvtier.sched.rotasched import PAPER_XFER_TOKENS, paper_xfer_blocks
from kvtier.sim.config import SimConfig
from kvtier.sim.hardware import HardwareProfile, load_hardware
from kvtier.sim.models import load_model

#: §5.1's node: GH200 (the shared profile's C2C rates) serving Qwen2.5-32B.
PAPER_HARDWARE, PAPER_MODEL = "gh200", "qwen2.5-32b"


def _duplex_rate(hw: HardwareProfile) -> float:
    """Host-to-device bytes per second while both directions copy (DuplexKV swaps both ways)."""
    return hw.host_link.h2d_bytes_per_s * hw.host_link.concurrent_scale


def xfer_blocks(config: SimConfig) -> tuple[int, int]:
    """B_xfer for ``config``'s node, in its blocks: (time-equal, token-equal)."""
    paper_hw, hw = load_hardware(PAPER_HARDWARE), load_hardware(config.hardware)
    paper_bytes = load_model(PAPER_MODEL).kv_bytes_per_token_per_gpu(1)
    seconds = PAPER_XFER_TOKENS * paper_bytes / _duplex_rate(paper_hw)
    # Each of the engine's tp GPUs moves its shard of every block over its own link.
    shard_bytes = config.block_tokens * load_model(config.model).kv_bytes_per_token_per_gpu(config.tp)
    time_equal = int(seconds * _duplex_rate(hw) // shard_bytes)
    return max(time_equal, 1), paper_xfer_blocks(config.block_tokens)


def with_xfer_budget(config: SimConfig, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` (a policy's parameters) with the time-equal ``xfer_blocks`` where policy ``name``
    takes one and ``spec`` leaves it out (or None)."""
    out = dict(spec)
    if out.get("xfer_blocks") is None and policy_class(name).takes_xfer_blocks:
        out["xfer_blocks"] = xfer_blocks(config)[0]
    return out
