"""The data plane a config gets where it names none: the one each policy's paper ran on.

How the engine moves KV is configuration (issue 18 step 4): the sim config's ``swap`` section
(:mod:`kvtier.sched.swap_copy`), ``fetch`` section (:mod:`kvtier.sched.fetch_path`) and ``load``
section (:mod:`kvtier.sched.load_path`), the P/D cluster's ``io`` section (:mod:`kvtier.sched.kv_io`),
the reference engine's ``EngineConfig.swap_engine``, and what the engines keep below the device (the
sim config's ``offload`` section, the reference engine's ``EngineConfig.offload``). A paper
reproduction is (policy, data-plane profile); where a config leaves a section's ``engine`` (or the
offload ``mode``) out, :func:`default_engine` (:func:`default_offload`) fills in the profile the
policy was evaluated on, so that ``policy: rotasched`` alone still runs on DuplexKV and ``policy:
hicache`` alone still writes through to host. Policies hold no data-plane setting of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.sched.section import checked_section

if TYPE_CHECKING:
    from kvtier.sched.base import Policy

#: The data-plane sections a config may name an engine in.
SECTIONS = ("swap", "fetch", "load", "io")

#: policy -> section -> the engine its paper ran it on (``offload``: the mode its paper's engine
#: kept below the device). Sections not listed: the plain engine (``offload``: ``none``).
EVALUATED_ON: dict[str, dict[str, str]] = {
    # SuperInfer §4.3: RotaSched's swaps moved by DuplexKV.
    "rotasched": {"swap": "duplexkv"},
    # SuperInfer §3.1: the static baselines on vLLM's own swap path.
    "waiting_first": {"swap": "vllm"},
    "swapped_first": {"swap": "vllm"},
    # ShadowServe §4.2-§4.3: the BlueField-3 chunked pipeline; §6.1: CacheGen-Async decodes on the GPU.
    "shadowserve_async": {"fetch": "bluefield3"},
    "cachegen_async": {"fetch": "cachegen_gpu"},
    # Strata §3.1, §5.1: SGLang-HiCache copies per page; §4.2: Strata's GPU-assisted I/O kernels.
    # Fig. 9's ablations: Strata's scheduling on HiCache's copies, HiCache's scheduling on Strata's.
    # Write-through to host: HiCache's, and Strata's (§4.1: the cache controller backs new KV up
    # to host asynchronously).
    "hicache": {"load": "per_page", "offload": "write_through"},
    "strata": {"load": "gpu_kernel", "offload": "write_through"},
    "strata_sched": {"load": "per_page", "offload": "write_through"},
    "strata_io": {"load": "gpu_kernel", "offload": "write_through"},
    # LMCache (Unified KV pooling §II-A, Fig. 1): computed prompt KV written through to host and SSD.
    "lmcache": {"offload": "write_through"},
    "lmcache_lp": {"offload": "write_through"},
    "lmcache_lp_async": {"offload": "write_through"},
    # DualPath §7.2: Basic without layerwise prefill; Oracle with every KV transfer bypassed.
    "dualpath_basic": {"io": "blocking"},
    "dualpath_oracle": {"io": "oracle"},
    # composed: DuplexKV under its `rotation` stage, the SmartNIC under `async_fetch` (compressed
    # loads come only from that stage, so the fetch path is idle without it), Strata's kernels under
    # `balance` (without it its loads are the plain FCFS or async-loading ones).
    "composed": {"swap": "duplexkv", "fetch": "bluefield3", "load": "gpu_kernel", "offload": "write_through"},
}
# Not listed (offload `none`): FCFS (vLLM's GPU prefix cache), RotaSched and the static swap
# policies (the host tier holds swapped requests' KV only), ShadowServe §6.1 and CacheGen-Async (a
# store other servers filled; local prefix caching disabled), DualPath (KV persists through storage,
# the simulator's DE writes, not host tiers).


def default_engine(policy: Mapping[str, Any], section: str) -> str:
    """The ``section`` engine the policy spec ``policy`` (``{name, ...params}``) was evaluated on:
    what a config's ``swap``/``fetch`` section means where it names no ``engine``."""
    name = str(policy.get("name"))
    engine = EVALUATED_ON.get(name, {}).get(section, "plain")
    if name == "composed" and section == "swap" and not _composed_runs(policy, "rotation"):
        return "plain"  # no rotation stage: composed never swaps
    if name == "composed" and section == "load" and not _composed_runs(policy, "balance"):
        return "plain"  # no balance stage: no Strata loads
    return engine


def default_offload(policy: Mapping[str, Any]) -> str:
    """What the engine of the policy spec ``policy``'s paper kept below the device: what the sim
    config's ``offload`` section (the reference engine's ``EngineConfig.offload``) means where it
    names no ``mode``."""
    return EVALUATED_ON.get(str(policy.get("name")), {}).get("offload", "none")


def policy_spec(policy: Policy) -> dict[str, Any]:
    """A built policy as the spec :func:`default_engine` reads (its name and parameters)."""
    return {"name": policy.name, **policy.params()}


def _composed_runs(spec: Mapping[str, Any], stage: str) -> bool:
    """Whether a composed spec runs ``stage`` (``rotation`` or ``balance``): in ``stages``, else the
    deprecated boolean of that name (on unless given off; both are default stages)."""
    stages = spec.get("stages")
    if stages is not None:
        return stage in stages
    return bool(spec.get(stage, True))


#: What an engine keeps below the device (the sim config's ``offload: {mode: ...}``).
OFFLOAD_MODES = ("none", "write_through", "write_back")


def offload_mode(section: Mapping[str, Any] | None) -> str | None:
    """The sim config's ``offload`` section's ``mode``; None where it names none (the policy's
    paper's engine's, :func:`default_offload`)."""
    if section is None:
        return None
    section = checked_section("offload", section, ("mode",), "{mode: write_through}")
    mode = section.get("mode")
    if mode is not None and mode not in OFFLOAD_MODES:
        raise ConfigError(f"offload `mode` is {mode!r}; expected one of {list(OFFLOAD_MODES)}")
    return None if mode is None else str(mode)
