"""Simulation config: a frozen dataclass from YAML or a dict; unknown keys and bad values raise
:class:`ConfigError` naming the key and what was expected.

```yaml
name: mooncake-hicache
seed: 0
hardware: h100-sxm          # a profile name (kvtier.sim.hardware.hardware_names()) or a YAML path
model: llama-3.1-8b         # a profile name (kvtier.sim.models.model_names()) or a YAML path
tp: 1
policy: {name: hicache}
engines: 1                  # colocated engines behind `router`; or prefill_engines + decode_engines for P/D
router: least_loaded        # round_robin | least_loaded | prefix_aware (default: the policy's, else least_loaded)
block_tokens: 512
host_capacity_bytes: auto   # auto = 80% of the node's DRAM, split among engines; 0 = no host tier
ssd_capacity_bytes: 0
remote_capacity_bytes: 0    # a Redis-like store behind the storage NIC; inf = unbounded
workload: {name: mooncake}
slo: {ttft_s: 5.0, tpot_s: 0.1}
# The data plane (mechanism, not policy; docs/simulator.md): each section optional, an `engine` left
# out is the one the policy's paper ran on (kvtier.sched.data_plane).
swap: {engine: plain}       # how swaps cross the host link (kvtier.sched.swap_copy)
fetch: {engine: plain}      # how compressed fetches reach the device (kvtier.sched.fetch_path)
load: {engine: per_page, page_tokens: 32}  # the copies loads cross the host link in (kvtier.sched.load_path)
pool: {layout: serial}      # host-memory modules and SSDs as devices (kvtier.sim.pool)
network: {traffic_isolation: true}  # the NICs' lanes (DualPath §5.1)
offload: {mode: write_through}  # what the engines keep below the device (default: the policy's paper's)
io: {layerwise: true}       # P/D prefill engines' KV intake: layerwise prefill, Oracle bypass (kvtier.sched.kv_io)
```
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import parse_size, read_yaml
from kvtier.errors import ConfigError, did_you_mean
from kvtier.sched.base import renamed
from kvtier.sched.data_plane import offload_mode
from kvtier.sched.fetch_path import fetch_path
from kvtier.sched.kv_io import kv_io
from kvtier.sched.load_path import load_path
from kvtier.sched.placement import ROUTERS
from kvtier.sched.section import checked_section
from kvtier.sched.swap_copy import swap_copy
from kvtier.tiers import Tier

_INF_WORDS = ("inf", "unbounded", "infinite")
_PRELOAD_TIERS = tuple(t.label for t in Tier if t is not Tier.DEVICE)  # host, ssd, remote


@dataclass(frozen=True)
class SimConfig:
    name: str = "sim"
    seed: int = 0
    hardware: str = "h100-sxm"
    model: str = "llama-3.1-8b"
    tp: int = 1
    policy: Mapping[str, Any] = field(default_factory=lambda: {"name": "fcfs"})
    engines: int = 1
    prefill_engines: int = 0
    decode_engines: int = 0
    # The global scheduler (kvtier.sched.placement: round_robin, least_loaded, prefix_aware); None:
    # the one the policy names (DualPath's, §6.1), else least_loaded.
    router: str | None = None
    block_tokens: int = 16
    max_batch_tokens: int = 8192
    max_running: int = 256
    gpu_memory_utilization: float = 0.9
    device_blocks: int | None = None  # override the HBM-derived device capacity
    host_capacity_bytes: int | str = "auto"
    ssd_capacity_bytes: int | str = 0
    remote_capacity_bytes: int | str = 0  # a remote store behind the storage NIC; "inf" = unbounded
    preload_tier: str | None = None  # host|ssd|remote: holds every prompt's KV before it arrives
    workload: Mapping[str, Any] = field(default_factory=lambda: {"name": "longdoc"})
    slo: Mapping[str, float] = field(default_factory=dict)
    cost: Mapping[str, Any] = field(default_factory=dict)  # {kind: roofline|fixed, ...params}
    max_outstanding_requests: int | None = None  # client concurrency cap (Strata §5.1: 128); None: open loop
    max_sim_s: float | None = None  # stop the clock here (None: run the workload to the end)
    # Host-memory modules and SSDs as separate devices (kvtier.sim.pool; Unified KV pooling §IV):
    # {dram_modules, filesystem_object_overhead_s}. None: the plain host link and striped SSDs.
    pool: Mapping[str, Any] | None = None
    device_prefix_cache: bool = True  # False: finished requests' KV leaves the GPU (vLLM without APC)
    # How swaps cross the host link (kvtier.sched.swap_copy): {engine: plain|vllm|naive|ms|ms_mk|
    # duplexkv}. None or no engine: the one the policy was evaluated on (kvtier.sched.data_plane).
    swap: Mapping[str, Any] | None = None
    # How compressed fetches reach the device (kvtier.sched.fetch_path): {engine: plain|bluefield3|
    # cachegen_gpu, compression_ratio, decode_bytes_per_s | decode_input_bytes_per_s,
    # decode_on_device, interference, duty_cycle}. None or no engine: the policy's, likewise.
    fetch: Mapping[str, Any] | None = None
    # The copies a load crosses the host link in (kvtier.sched.load_path): {engine: plain|per_page|
    # gpu_kernel, copy, page_tokens, interference, layerwise_interference}. None or no engine: the
    # policy's, likewise.
    load: Mapping[str, Any] | None = None
    # The compute NICs (DualPath §5.1): {traffic_isolation: true}, KV transfers in the low-priority
    # lane behind the model's collectives (the default); false: one lane shared. None: the defaults.
    network: Mapping[str, Any] | None = None
    # The node-group (DualPath) cluster's KV intake (kvtier.sched.kv_io): {engine: plain|blocking|
    # oracle, layerwise, bypass}. None or no engine: the policy's paper's.
    io: Mapping[str, Any] | None = None
    # What the engines keep below the device: {mode: none|write_through|write_back}. None or no
    # mode: the policy's paper's engine's (kvtier.sched.data_plane.default_offload).
    offload: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "engines", "block_tokens", "max_batch_tokens", "max_running"):
            _positive_int(name, getattr(self, name))
        for name in ("prefill_engines", "decode_engines", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"sim `{name}` is {value!r}; expected an int >= 0")
        if (self.prefill_engines > 0) != (self.decode_engines > 0):
            raise ConfigError("P/D needs both `prefill_engines` and `decode_engines` >= 1 (or neither)")
        if self.prefill_engines > 0 and self.engines != 1:
            raise ConfigError(
                f"sim `engines` is {self.engines} with P/D groups (`prefill_engines` "
                f"{self.prefill_engines}, `decode_engines` {self.decode_engines}); a P/D cluster is "
                "sized by its two groups: drop `engines`"
            )
        if self.router is not None and self.router not in ROUTERS:
            raise ConfigError(
                f"unknown router {self.router!r}{did_you_mean([self.router], ROUTERS)}; "
                f"expected one of {list(ROUTERS)}"
            )
        if not _is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"`gpu_memory_utilization` is {self.gpu_memory_utilization!r}; expected a number in (0, 1]"
            )
        if self.device_blocks is not None:
            _positive_int("device_blocks", self.device_blocks)
        for name in ("policy", "workload"):
            spec = getattr(self, name)
            if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
                raise ConfigError(f"sim `{name}` is {spec!r}; expected a mapping with a `name`")
        unknown = sorted(set(self.slo) - {"ttft_s", "tpot_s"})
        if unknown:
            raise ConfigError(f"unknown slo key(s) {unknown}; expected some of ['tpot_s', 'ttft_s']")
        for key, value in self.slo.items():
            if not _is_number(value) or not 0 < value < math.inf:  # NaN and booleans too
                raise ConfigError(f"slo `{key}` is {value!r}; expected a positive number of seconds")
        if self.max_outstanding_requests is not None:
            _positive_int("max_outstanding_requests", self.max_outstanding_requests)
        if self.max_sim_s is not None and (
            not _is_number(self.max_sim_s) or not 0 < self.max_sim_s < math.inf
        ):
            raise ConfigError(f"`max_sim_s` is {self.max_sim_s!r}; expected a positive number of seconds")
        self.capacity_bytes("host_capacity_bytes", 0)  # validates the value
        self.capacity_bytes("ssd_capacity_bytes", 0)
        self.capacity_bytes("remote_capacity_bytes", 0)
        if self.preload_tier is not None and self.preload_tier not in _PRELOAD_TIERS:
            raise ConfigError(f"`preload_tier` is {self.preload_tier!r}; expected host, ssd or remote")
        if self.pool is not None:
            from kvtier.sim.pool import PoolSpec

            PoolSpec.from_mapping(self.pool)  # validates the section
        swap_copy(self.swap, "plain")  # validates the section
        fetch_path(self.fetch, "plain")  # validates the section
        load_path(self.load, "plain")  # validates the section
        kv_io(self.io, "plain")  # validates the section
        offload_mode(self.offload)  # validates the section
        network_isolation(self.network)  # validates the section
        if not isinstance(self.device_prefix_cache, bool):
            raise ConfigError(
                f"`device_prefix_cache` is {self.device_prefix_cache!r}; expected true or false"
            )

    def capacity_bytes(self, name: str, auto_bytes: int) -> int | None:
        """Bytes of a tier: ``auto`` → ``auto_bytes``; ``inf`` → None (unbounded); 0 → no tier."""
        value = getattr(self, name)
        if isinstance(value, str) and value.strip().lower() == "auto":
            return auto_bytes
        if isinstance(value, str) and value.strip().lower() in _INF_WORDS:
            return None
        size = parse_size(value, name)
        if size < 0:
            raise ConfigError(f"`{name}` is {value!r}; expected a size >= 0")
        return size

    @property
    def traffic_isolation(self) -> bool:
        """The ``network`` section's ``traffic_isolation`` (default true)."""
        return network_isolation(self.network)

    @property
    def disaggregated(self) -> bool:
        return self.prefill_engines > 0

    def with_overrides(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"sim config must be a mapping; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown sim config key(s) {unknown}{did_you_mean(unknown, known)}; expected some of {sorted(known)}"
            )
        fields = dict(data)
        for name in ("policy", "workload"):
            if isinstance(fields.get(name), str):
                fields[name] = {"name": fields[name]}
        return cls(**fields)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SimConfig:
        """From a YAML file, or a bundled experiment's name (``baselines/mooncake_h100_hicache``,
        with or without ``.yaml``, relative to :func:`experiments_dir`) when no such file exists."""
        data = read_yaml(resolve_experiment(path), "sim config")
        return cls.from_dict(data if data is not None else {})


def resolve_deprecated(config: SimConfig) -> SimConfig:
    """``config`` in current spelling: a deprecated policy name (DeprecationWarning) becomes the
    policy that decides the same, and the data-plane keys it implied fill the config's ``pool``
    section where the section is present and leaves them out (the run is unchanged). ``composed``
    in its old spelling (no ``stages``; its ``pool`` piece on, the default) implies the unified
    pool's layout the same way. A policy's ``transfer`` (RotaSched, the static swap policies, and
    composed's ``rotasched`` parameters) becomes the ``swap`` section's ``engine``, likewise,
    ShadowServe's and CacheGen-Async's fetch parameters become the ``fetch`` section's keys, and
    HiCache's and Strata's copy parameters (``page_tokens``, ``io``) the ``load`` section's. LMCache's
    ``chunk_tokens`` (its object size, which never reached the engine: the objects are
    ``block_tokens``) is dropped with a warning naming ``block_tokens``. DualPath's ``layerwise``
    becomes the ``io`` section's key, likewise, and ShadowServe's ``store_writes`` the ``offload``
    section's ``mode``."""
    spec = dict(config.policy)
    name, implied = renamed(str(spec["name"]))
    pool = config.pool
    swap = config.swap
    fetch = _fetch_keys(name, spec, config.fetch)
    network = _network_keys(name, spec, config.network)
    io = _io_keys(name, spec, config.io)
    offload = _offload_keys(name, spec, config.offload)
    load = _load_keys(name, spec, config.load)
    chunk = _drop_chunk_tokens(name, spec, config.block_tokens)
    transfer = spec.pop("transfer", None)
    rota = spec.get("rotasched")
    if transfer is None and isinstance(rota, Mapping) and "transfer" in rota:
        rota = dict(rota)
        transfer = rota.pop("transfer")
        spec["rotasched"] = rota
    if transfer is not None:
        warnings.warn(
            f"policy parameter `transfer` is deprecated: use swap.engine: {transfer!r} (the swap "
            "copy is data-plane config)",
            DeprecationWarning,
            stacklevel=2,
        )
        if swap is None or "engine" not in swap:
            swap = {**(swap or {}), "engine": transfer}
    old_composed = name == "composed" and "stages" not in spec and spec.get("pool", True)
    if old_composed and pool is not None and not {"layout", "passthrough"} <= set(pool):
        warnings.warn(
            "composed without `stages` and a pool section without `layout`/`passthrough` is "
            "deprecated: add pool.layout: 'pooled', pool.passthrough: True (what it meant)",
            DeprecationWarning,
            stacklevel=2,
        )
        implied = {"pool": {"layout": "pooled", "passthrough": True}}  # the old `pool: true` default
    sections = ((fetch, config.fetch), (network, config.network), (load, config.load), (io, config.io))
    unchanged = all(new is old for new, old in (*sections, (offload, config.offload)))
    if name == spec["name"] and not implied and transfer is None and unchanged and not chunk:
        return config
    if pool is not None and "pool" in implied:
        pool = {**implied["pool"], **pool}
    return config.with_overrides(
        policy={**spec, "name": name},
        pool=pool,
        swap=swap,
        fetch=fetch,
        network=network,
        load=load,
        io=io,
        offload=offload,
    )


# Policy parameters that described the fetch data plane (deprecated): now the `fetch` section's keys.
_FETCH_POLICIES = ("shadowserve_async", "cachegen_async")
_FETCH_PARAMS = (
    "compression_ratio",
    "decode_bytes_per_s",
    "decode_input_bytes_per_s",
    "interference",
    "duty_cycle",
)


# Policy parameters that described the load path (deprecated): now the `load` section's keys.
_LOAD_POLICIES = ("hicache", "strata", "strata_sched")
_IO_ENGINES = {"gpu": "gpu_kernel", "page": "per_page"}  # Strata's old `io` -> load.engine


def _load_keys(name: str, spec: dict[str, Any], load: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Moves HiCache's and Strata's deprecated copy parameters (``page_tokens``; Strata's ``io``,
    also inside composed's ``strata``) out of ``spec`` into the ``load`` section (where the section
    does not set them already), with a DeprecationWarning naming the keys."""
    params = spec
    if name == "composed" and isinstance(spec.get("strata"), Mapping):
        params = spec["strata"] = dict(spec["strata"])
    elif name not in _LOAD_POLICIES:
        return load
    moved: dict[str, Any] = {}
    if "io" in params:
        io = params.pop("io")
        if io not in _IO_ENGINES:
            raise ConfigError(
                f"policy {name!r} parameter `io` is {io!r}; expected one of {list(_IO_ENGINES)}"
            )
        moved["engine"] = _IO_ENGINES[io]
    if "page_tokens" in params:
        moved["page_tokens"] = params.pop("page_tokens")
    if not moved:
        return load
    keys = ", ".join(f"load.{k}: {v!r}" for k, v in moved.items())
    warnings.warn(
        f"policy {name!r} parameters {sorted(k if k != 'engine' else 'io' for k in moved)} are "
        f"deprecated: use {keys} (the load's copies are data-plane config)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {**moved, **(load or {})}


_CHUNK_POLICIES = ("lmcache", "lmcache_lp", "lmcache_lp_async")


def _drop_chunk_tokens(name: str, spec: dict[str, Any], block_tokens: int) -> bool:
    """Drops LMCache's deprecated ``chunk_tokens`` from ``spec`` (checked, with a DeprecationWarning
    naming ``block_tokens``, the object size the engine moves); whether there was one."""
    if name not in _CHUNK_POLICIES or "chunk_tokens" not in spec:
        return False
    chunk = spec.pop("chunk_tokens")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"policy {name!r} parameter `chunk_tokens` is {chunk!r}; expected an int >= 1")
    warnings.warn(
        f"policy {name!r} parameter `chunk_tokens` is deprecated: LMCache's object size is the "
        f"config's block_tokens ({block_tokens}; chunk_tokens {chunk} was never read)",
        DeprecationWarning,
        stacklevel=3,
    )
    return True


def network_isolation(network: Mapping[str, Any] | None) -> bool:
    """The sim config's ``network`` section's ``traffic_isolation``: true where it is left out."""
    if network is None:
        return True
    network = checked_section("network", network, ("traffic_isolation",), "{traffic_isolation: true}")
    value = network.get("traffic_isolation", True)
    if not isinstance(value, bool):
        raise ConfigError(f"network `traffic_isolation` is {value!r}; expected true or false")
    return value


def _offload_keys(
    name: str, spec: dict[str, Any], offload: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """Moves ShadowServe's deprecated ``store_writes`` out of ``spec``: true becomes the ``offload``
    section's ``mode: write_through`` (where the section does not set a mode), with a warning."""
    if name != "shadowserve_async" or "store_writes" not in spec:
        return offload
    value = spec.pop("store_writes")
    if not isinstance(value, bool):
        raise ConfigError(f"policy {name!r} parameter `store_writes` is {value!r}; expected true or false")
    mode = "write_through" if value else "none"
    warnings.warn(
        f"policy {name!r} parameter `store_writes` is deprecated: use offload.mode: {mode!r} (what the "
        "engine keeps below the device is data-plane config)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {"mode": mode, **(offload or {})}


def _io_keys(name: str, spec: dict[str, Any], io: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Moves DualPath's deprecated ``layerwise`` parameter out of ``spec`` into the ``io`` section
    (where the section does not set it already), with a DeprecationWarning naming the key."""
    if not name.startswith("dualpath") or "layerwise" not in spec:
        return io
    value = spec.pop("layerwise")
    warnings.warn(
        f"policy {name!r} parameter `layerwise` is deprecated: use io.layerwise: {value!r} (layerwise "
        "prefill is data-plane config)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {"layerwise": value, **(io or {})}


def _network_keys(
    name: str, spec: dict[str, Any], network: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """Moves DualPath's deprecated ``traffic_isolation`` parameter out of ``spec`` into the
    ``network`` section (where the section does not set it already), with a DeprecationWarning."""
    if not name.startswith("dualpath") or "traffic_isolation" not in spec:
        return network
    value = spec.pop("traffic_isolation")
    warnings.warn(
        f"policy {name!r} parameter `traffic_isolation` is deprecated: use network.traffic_isolation: "
        f"{value!r} (the NICs' lanes are deployment config)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {"traffic_isolation": value, **(network or {})}


def _fetch_keys(name: str, spec: dict[str, Any], fetch: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Moves a fetch policy's deprecated data-plane parameters out of ``spec`` into the ``fetch``
    section (where the section does not set them already), with a DeprecationWarning naming the keys."""
    moved = {k: spec.pop(k) for k in _FETCH_PARAMS if name in _FETCH_POLICIES and k in spec}
    if not moved:
        return fetch
    keys = ", ".join(f"fetch.{k}: {v!r}" for k, v in moved.items())
    warnings.warn(
        f"policy {name!r} parameters {sorted(moved)} are deprecated: use {keys} (the fetch path is "
        "data-plane config)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {**moved, **(fetch or {})}


def experiments_dir() -> Path:
    """The experiment configs shipped inside the package (``kvtier/experiments/``; ``experiments/``
    at a checkout's root links there), or $KVTIER_EXPERIMENTS."""
    env = os.environ.get("KVTIER_EXPERIMENTS")
    directory = Path(env) if env else Path(__file__).resolve().parents[1] / "experiments"
    if not directory.is_dir():
        raise ConfigError(f"experiment configs not found at {directory}; set KVTIER_EXPERIMENTS")
    return directory


def resolve_experiment(path: str | Path) -> Path:
    """`path` when it names a file; else the bundled experiment of that name, if there is one."""
    given = Path(path)
    if given.is_file() or given.is_absolute():
        return given
    for candidate in (given, given.with_name(given.name + ".yaml")):
        bundled = experiments_dir() / candidate
        if bundled.is_file():
            return bundled
    return given  # read_yaml names the missing file


def _is_number(value: object) -> bool:
    """An int or float, not a bool (YAML's ``true`` is an int to Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"sim `{name}` is {value!r}; expected an int >= 1")
