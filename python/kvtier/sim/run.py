"""Builds a simulated cluster from a :class:`SimConfig`, replays its workload, returns JSON-ready
results. ``sweep`` repeats a run over request rates."""

from __future__ import annotations

import dataclasses
import gc
import math
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from kvtier.errors import ConfigError, SimError
from kvtier.progress import progress
from kvtier.sched import make_policy
from kvtier.sched.base import Policy, policy_class
from kvtier.sched.data_plane import default_engine, default_offload, offload_mode, policy_spec
from kvtier.sched.dualpath import DualPath, DualPathScheduler
from kvtier.sched.fetch_path import fetch_path
from kvtier.sched.load_path import load_path
from kvtier.sched.placement import GlobalScheduler, make_router
from kvtier.sched.swap_copy import swap_copy
from kvtier.sim.cluster import Cluster
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import CostModel, engine_kv_bytes_per_token, make_cost_model
from kvtier.sim.dualpath import DualPathCluster
from kvtier.sim.engine import Engine, EngineConfig
from kvtier.sim.hardware import HardwareProfile, load_hardware
from kvtier.sim.metrics import Metrics, SimMetrics
from kvtier.sim.models import ModelProfile, load_model
from kvtier.sim.pool import PoolSpec, build_pool
from kvtier.sim.request import Request
from kvtier.sim.resources import Link, StripedLink
from kvtier.sim.stall import check_not_stalled
from kvtier.sim.workload import make_workload
from kvtier.sim.xfer import with_xfer_budget
from kvtier.tiers import Tier

# Bytes of HBM kept for activations and the CUDA context beyond the weights (vLLM-like).
ACTIVATION_RESERVE_BYTES = 4 * 2**30


class ClusterShape(TypedDict):
    """:func:`cluster_shape`: the cluster a run replayed on."""

    engines: int
    prefill_engines: int
    decode_engines: int
    router: str
    requests_per_engine: list[int] | None


class SimResult(SimMetrics):
    """:func:`run`: the run's metrics and the run itself (``kvtier sim run --json``)."""

    config: str
    policy: dict[str, object]  # the config's policy section, as written
    policy_params: dict[str, object]  # the policy as built: defaults and the node's B_xfer filled in
    hardware: str
    model: str
    events: int
    sim_time_s: float
    wall_s: float
    cpu_s: float
    unfinished_requests: int
    cluster: ClusterShape
    peak_rss_bytes: int


class RateRun(SimResult):
    """One run of a :func:`sweep`: its results at the workload rate it ran."""

    rate_per_s: float


class SweepResult(TypedDict):
    """``kvtier sim sweep``: each policy's runs, one per rate, and the plots drawn of them."""

    config: str
    rates_per_s: list[float]
    series: dict[str, list[RateRun]]
    plots: list[str]


class SimCluster(Protocol):
    """What a run needs of a cluster: :class:`Cluster` (engines behind a global scheduler, each with
    its own links) or :class:`DualPathCluster` (engine groups on a node :class:`Topology`)."""

    def feed(self, requests: Iterator[Request]) -> None: ...
    def unfinished_requests(self) -> int: ...


@dataclass
class Simulation:
    config: SimConfig
    loop: EventLoop
    cluster: SimCluster
    metrics: Metrics
    links: dict[str, Link]
    hardware: HardwareProfile
    model: ModelProfile
    report: Callable[[], SimMetrics] | None = None  # the cluster's own results, where it has them

    def result(self) -> SimMetrics:
        """Metrics and link statistics (the run-level fields are :func:`run`'s)."""
        if self.report is not None:
            return self.report()
        return self.metrics.result(_link_stats(self))


def device_blocks(config: SimConfig, hw: HardwareProfile, model: ModelProfile, cost: CostModel) -> int:
    if config.device_blocks is not None:
        return config.device_blocks
    per_gpu = hw.hbm_capacity_bytes * config.gpu_memory_utilization
    free = per_gpu - model.weight_bytes() / config.tp - ACTIVATION_RESERVE_BYTES
    blocks = int(free // (config.block_tokens * cost.kv_bytes_per_token))
    if blocks < 1:
        raise SimError(
            f"model {model.name!r} (tp={config.tp}) leaves no HBM for KV on {hw.name!r}: "
            f"{model.weight_bytes() / config.tp / 2**30:.1f} GiB of weights per GPU vs "
            f"{per_gpu / 2**30:.1f} GiB usable; raise tp or pick a larger GPU"
        )
    return blocks


def global_scheduler(config: SimConfig, policy: type[Policy]) -> GlobalScheduler | str:
    """The run's global scheduler: ``router`` where the config names one, else the one the policy
    class names (DualPath's, §6.1), else ``least_loaded``. A name where it needs a cluster to build it."""
    if config.router is not None:
        return make_router(config.router)
    name = policy.global_scheduler
    return make_router("least_loaded") if name is None else name


def build(config: SimConfig) -> Simulation:
    config = resolve_deprecated(config)
    hw = load_hardware(config.hardware)
    model = load_model(config.model)
    policy_spec = dict(config.policy)
    policy_name = str(policy_spec.pop("name"))
    scheduler = global_scheduler(config, policy_class(policy_name))
    policy_spec = with_xfer_budget(config, policy_name, policy_spec)  # B_xfer for this node
    if isinstance(scheduler, str):  # needs node groups: DualPath's PE/DE groups and NICs
        policy = make_policy(policy_name, **policy_spec)
        if scheduler != DualPathScheduler.name or not isinstance(policy, DualPath):
            raise ConfigError(f"global scheduler {scheduler!r} needs a dualpath policy; got {policy_name!r}")
        if config.tp != 1:  # refused rather than ignored: its engines are one GPU each
            raise ConfigError(
                f"sim `tp` is {config.tp}, but the node-group (dualpath) cluster runs one GPU per engine, "
                f"its model spread by expert parallelism over `prefill_engines` / `decode_engines`: drop `tp`"
            )
        dp = DualPathCluster(config, policy)
        return Simulation(config, dp.loop, dp, dp.metrics, dp.links, dp.hw, dp.model, dp.result)
    if config.io is not None:  # read only by the node-group cluster: refuse rather than ignore
        raise ConfigError(
            f"sim `io` is {dict(config.io)!r}, but only the node-group (dualpath) cluster reads it; "
            f"policy {policy_name!r} runs per engine: drop `io`"
        )
    cost_spec = dict(config.cost)
    cost = make_cost_model(str(cost_spec.pop("kind", "roofline")), hw, model, tp=config.tp, **cost_spec)
    loop = EventLoop()
    metrics = Metrics(slo_ttft_s=config.slo.get("ttft_s"), slo_tpot_s=config.slo.get("tpot_s"))
    # A block below the device is all the engine's GPUs' bytes; HBM (device_blocks) is one GPU's.
    block_bytes = config.block_tokens * engine_kv_bytes_per_token(cost, config.tp)
    host_auto = int(0.8 * hw.dram_capacity_bytes * config.tp)
    host_bytes = config.capacity_bytes("host_capacity_bytes", host_auto)
    ssd_bytes = config.capacity_bytes("ssd_capacity_bytes", 0)
    remote_bytes = config.capacity_bytes("remote_capacity_bytes", 0)
    unbounded = 2**62 // max(block_bytes, 1)
    host_blocks = unbounded if host_bytes is None else host_bytes // block_bytes
    ssd_blocks = unbounded if ssd_bytes is None else ssd_bytes // block_bytes
    remote_blocks = unbounded if remote_bytes is None else remote_bytes // block_bytes
    links: dict[str, Link] = {}
    ssd_link: Link | StripedLink | None = None
    if ssd_blocks > 0 and config.pool is None:
        if hw.ssd_count == 0:
            raise ConfigError(f"`ssd_capacity_bytes` is set but hardware {hw.name!r} has no SSDs")
        # The node's SSDs (this GPU group's share), each a half-duplex device with its own queue,
        # striped: every SSD read or write is split evenly across them.
        devices = [
            Link(loop, f"ssd{i}", hw.ssd_read_bytes_per_s, hw.ssd_write_bytes_per_s, duplex=False)
            for i in range(hw.ssd_count * config.tp)
        ]
        ssd_link = StripedLink(Tier.SSD.label, devices)
        links.update((d.name, d) for d in devices)
    remote_link = None
    if remote_blocks > 0:
        nic = hw.storage_nic_bytes_per_s * config.tp
        if nic <= 0:
            raise ConfigError(f"`remote_capacity_bytes` is set but hardware {hw.name!r} has no storage NIC")
        # One shared remote store; every engine reaches it through the node's storage NICs.
        remote_link = Link(loop, Tier.REMOTE.label, nic, nic)
        links[remote_link.name] = remote_link
    engine_config = EngineConfig(
        block_tokens=config.block_tokens,
        device_blocks=device_blocks(config, hw, model, cost),
        host_blocks=host_blocks,
        ssd_blocks=ssd_blocks,
        remote_blocks=remote_blocks,
        max_batch_tokens=config.max_batch_tokens,
        max_running=config.max_running,
        preload_tier=Tier.parse(config.preload_tier) if config.preload_tier is not None else None,
        device_prefix_cache=config.device_prefix_cache,
        # The data plane: the config's sections, else what the policy was evaluated on.
        swap_copy=swap_copy(config.swap, default_engine(config.policy, "swap")),
        fetch=fetch_path(config.fetch, default_engine(config.policy, "fetch")),
        load=load_path(config.load, default_engine(config.policy, "load")),
        offload=offload_mode(config.offload) or default_offload(config.policy),
        tp=config.tp,
    )
    host_store_link: Link | StripedLink | None = None
    if config.pool is not None:  # DRAM modules and SSDs as separate devices (kvtier.sim.pool)
        pool = build_pool(
            PoolSpec.from_mapping(config.pool),
            hw,
            loop,
            block_bytes,
            cost.num_layers,
            engine_config.host_blocks,
            engine_config.ssd_blocks,
            config.tp,
        )
        host_store_link, ssd_link = pool.host_store, pool.ssd
        engine_config = dataclasses.replace(
            engine_config, host_blocks=pool.host_blocks, ssd_blocks=pool.ssd_blocks
        )
        links.update((d.name, d) for d in pool.devices)

    def engine(name: str) -> Engine:
        link = Link.of(loop, f"{name}.host", hw.host_link, config.tp)
        links[link.name] = link
        return Engine(
            loop,
            name,
            engine_config,
            cost,
            make_policy(policy_name, **policy_spec),
            metrics,
            link,
            ssd_link,
            remote_link,
            host_store_link=host_store_link,
        )

    if config.disaggregated:
        prefill = [engine(f"p{i}") for i in range(config.prefill_engines)]
        decode = [engine(f"d{i}") for i in range(config.decode_engines)]
        pd_bw = hw.compute_nic_bytes_per_s * config.tp
        if pd_bw <= 0:
            raise ConfigError(f"P/D needs a compute NIC; hardware {hw.name!r} has none")
        pd_link = Link(loop, "pd", pd_bw, pd_bw)
        links["pd"] = pd_link
        cluster = Cluster(loop, metrics, prefill, decode, pd_link, router=scheduler)
    else:
        engines = [engine(f"e{i}") for i in range(config.engines)]
        cluster = Cluster(loop, metrics, engines, router=scheduler)
    cluster.max_outstanding = config.max_outstanding_requests  # checked >= 1 by SimConfig
    return Simulation(config, loop, cluster, metrics, links, hw, model)


def workload(config: SimConfig) -> Iterator[Request]:
    """The run's requests. Their block keys are cut at the config's ``block_tokens``, the run's one
    block size: a workload section's own ``block_tokens`` (accepted before, silently able to differ
    from the engines') is deprecated when equal and refused when not."""
    spec = dict(config.workload)
    name = spec.pop("name")
    own = spec.pop("block_tokens", config.block_tokens)
    if own != config.block_tokens:
        raise ConfigError(
            f"workload `block_tokens` is {own!r} but the run's `block_tokens` is {config.block_tokens}: "
            "set the block size once, at the top level"
        )
    if "block_tokens" in config.workload:
        warnings.warn(
            "workload `block_tokens` is deprecated: the run's block size is the top-level `block_tokens`",
            DeprecationWarning,
            stacklevel=2,
        )
    spec["block_tokens"] = config.block_tokens
    spec.setdefault("seed", config.seed)
    return make_workload(name, **spec)


def run(
    config: SimConfig,
    show_progress: bool = False,
    expected_requests: int | None = None,
    progress_label: str = "sim",
) -> SimResult:
    """Runs ``config`` to completion (or ``max_sim_s``) and returns its results, with the cluster it
    ran on (``cluster``: engines, router, requests placed per engine) and this process's peak RSS so
    far (``peak_rss_bytes``: the run's own peak when it is the process's only run, as in
    ``kvtier sim run``). Requests stream in from the workload and finished ones are folded into the
    metrics, so memory follows the requests in flight, not the trace."""
    wall_start = time.perf_counter()
    cpu_start = time.process_time()
    sim = build(config)
    requests = workload(config)
    if show_progress:  # counts requests as they are pulled in (arrivals), total when known
        requests = _counting(requests, expected_requests, progress_label)
    sim.cluster.feed(requests)
    replay(sim, config.max_sim_s)
    return {
        **sim.result(),
        "config": config.name,
        "policy": dict(config.policy),
        "policy_params": built_policy(sim),
        "hardware": sim.hardware.name,
        "model": sim.model.name,
        "events": sim.loop.events_run,
        "sim_time_s": sim.loop.now_s,
        "wall_s": time.perf_counter() - wall_start,
        "cpu_s": time.process_time() - cpu_start,
        "unfinished_requests": sim.cluster.unfinished_requests(),
        "cluster": cluster_shape(sim),
        "peak_rss_bytes": peak_rss_bytes(),
    }


_GC_THRESHOLD = 20_000  # allocations between young-generation collections (CPython's default: 700)


def replay(sim: Simulation, until_s: float | None = None) -> None:
    """Runs ``sim``'s events to the end (or ``until_s``); a replay whose events ran out with requests
    unfinished stalled, and raises :class:`SimError` naming its engines (:mod:`kvtier.sim.stall`).

    The cyclic garbage collector runs less often meanwhile (a replay allocates millions of short-
    lived objects, few in cycles: at CPython's default threshold it ran ~350 collections, ~4% of a
    12K-request replay's CPU); memory is reclaimed by reference counting as before."""
    threshold = gc.get_threshold()
    gc.set_threshold(_GC_THRESHOLD, *threshold[1:])
    try:
        sim.loop.run(until_s=until_s)
    finally:
        gc.set_threshold(*threshold)
    cluster = sim.cluster
    engines = cluster.engines + cluster.decode_engines if isinstance(cluster, Cluster) else []
    check_not_stalled(sim.loop, cluster, engines, sim.metrics.steps)


def built_policy(sim: Simulation) -> dict[str, object]:
    """The policy the run replayed with (every engine builds the same one): its name and every
    parameter, those the config left out included."""
    cluster = sim.cluster
    if isinstance(cluster, DualPathCluster):
        return policy_spec(cluster.policy)
    if not isinstance(cluster, Cluster):
        raise SimError(f"a cluster of type {type(cluster).__name__} has no policy to report")
    return policy_spec(cluster.engines[0].policy)


def cluster_shape(sim: Simulation) -> ClusterShape:
    """The cluster a run replayed on, as configured (nothing is chosen for it): colocated
    ``engines`` or P/D groups, the global scheduler, and how many requests it placed on each
    (prefill or colocated) engine of a :class:`Cluster` (None for node groups)."""
    c, cluster = sim.config, sim.cluster
    placed = list(cluster.placed) if isinstance(cluster, Cluster) else None
    router = cluster.scheduler.name if isinstance(cluster, Cluster) else DualPathScheduler.name
    return {
        "engines": 0 if c.disaggregated else c.engines,
        "prefill_engines": c.prefill_engines,
        "decode_engines": c.decode_engines,
        "router": router,
        "requests_per_engine": placed,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _counting(requests: Iterator[Request], total: int | None, label: str) -> Iterator[Request]:
    yield from progress(requests, total, label)


def _link_stats(sim: Simulation) -> dict[str, dict[str, float]]:
    span = max(sim.loop.now_s, 1e-12)
    out = {}
    for name, link in sim.links.items():
        busy = link.busy_s()
        out[name] = {
            "utilisation_in": busy[0] / span,
            "utilisation_out": (busy[1] if len(busy) > 1 else busy[0]) / span,
            "bytes_in": float(link.bytes_moved[0]),
            "bytes_out": float(link.bytes_moved[1]),
        }
    return out


def sweep(config: SimConfig, rates_per_s: Sequence[float], show_progress: bool = False) -> list[RateRun]:
    """Runs ``config`` once per request rate (the workload's ``rate_per_s``)."""
    results: list[RateRun] = []
    for rate in progress(rates_per_s, len(rates_per_s), "sweep", enabled=show_progress):
        if not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"sweep rate {rate!r}; expected positive request rates")
        workload_spec = {**config.workload, "rate_per_s": rate}
        results.append({**run(config.with_overrides(workload=workload_spec)), "rate_per_s": rate})
    return results
