"""An engine of ``tp`` GPUs below its device (kvtier.sim.cost.engine_kv_bytes_per_token): each GPU
holds its own part of every block (its shard of the KV heads, or its own copy of a replicated MLA
latent), so what the engine stores below the device and moves is ``tp`` parts, each over its own
GPU's share of the links (the simulator's links are ``tp`` shares side by side).

The invariant every test here checks: an engine of ``tp`` GPUs moves a block set in exactly the time
ONE GPU takes to move its part over ONE GPU's share of each link, and a number of bytes below the
device holds the blocks whose parts on all ``tp`` GPUs fit in it. HBM stays one GPU's.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.sched.base import LoadMode, LoadOrder, Phase
from kvtier.sched.swap_copy import PLAIN_SWAP
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventLoop
from kvtier.sim.engine import Engine
from kvtier.sim.hardware import load_hardware
from kvtier.sim.models import load_model
from kvtier.sim.pool import PoolSpec, build_pool
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link, StripedLink
from kvtier.sim.run import build, run
from kvtier.sim.state import SimRequest
from kvtier.tiers import Tier

BT = 16  # block tokens
BLOCKS = 64  # blocks moved by each transfer below
HW = load_hardware("h100-sxm")
SHARDED, MLA = "llama-3.1-8b", "deepseek-v3"  # 8 KV heads split over the GPUs; one latent on each


def engine(model: str, tp: int, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {
        "device_blocks": 10_000,
        "host_capacity_bytes": "1GiB",
        "ssd_capacity_bytes": "1TiB",
        "remote_capacity_bytes": "1TiB",
        **overrides,
    }
    config = SimConfig(name="tp", model=model, tp=tp, block_tokens=BT, **fields)
    e = build(config).cluster.engines[0]  # type: ignore[attr-defined]
    assert isinstance(e, Engine)
    return e


def gpu_bytes(model: str, tp: int, blocks: int = 1) -> int:
    """One GPU's part of ``blocks`` blocks of an engine of ``tp`` GPUs."""
    return blocks * BT * load_model(model).kv_bytes_per_token_per_gpu(tp)


def one_gpu_links() -> tuple[Link, StripedLink, Link]:
    """One GPU's share of the host link, of the node's SSDs and of its storage NIC."""
    loop = EventLoop()
    ssds = [
        Link(loop, f"ssd{i}", HW.ssd_read_bytes_per_s, HW.ssd_write_bytes_per_s, duplex=False)
        for i in range(HW.ssd_count)
    ]
    nic = HW.storage_nic_bytes_per_s
    return Link.of(loop, "host", HW.host_link), StripedLink("ssd", ssds), Link(loop, "nic", nic, nic)


def load_s(e: Engine, tier: Tier) -> float:
    """Seconds the engine takes to load BLOCKS blocks from ``tier`` to the device, links idle."""
    landed: list[float] = []
    order = LoadOrder(0, BLOCKS * BT, LoadMode.ASYNC)
    e.start_load_transfers(order, [(i, tier) for i in range(BLOCKS)], lambda: landed.append(e.loop.now_s))
    e.loop.run()
    [at] = landed
    return at


@pytest.mark.parametrize(("model", "tp"), [(SHARDED, 2), (SHARDED, 4), (MLA, 2)])
@pytest.mark.parametrize("tier", [Tier.HOST, Tier.SSD, Tier.REMOTE])
def test_a_load_at_tp_takes_one_gpus_part_over_one_gpus_links(model: str, tp: int, tier: Tier) -> None:
    """Every GPU loads its part of each block over its own host link (and its share of the SSDs or
    the storage NIC), all at once: the load takes what one GPU's part takes on one GPU's links,
    and the policy's estimate says the same. (Before, the engine moved one GPU's part over all tp
    GPUs' links: tp times too fast.)"""
    e = engine(model, tp)
    host, ssd, nic = one_gpu_links()
    part, block_part = gpu_bytes(model, tp, BLOCKS), gpu_bytes(model, tp)
    expected = host.work_s(part, block_part, Direction.IN)
    if tier is not Tier.HOST:
        store = ssd if tier is Tier.SSD else nic
        expected = max(expected, store.work_s(part, block_part, Direction.IN))
    assert load_s(e, tier) == pytest.approx(expected, rel=1e-12)
    assert e.load_paths.estimate_s(BLOCKS * BT, tier, LoadMode.ASYNC) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.SSD])
def test_a_replicated_latent_loads_no_faster_on_more_gpus(tier: Tier) -> None:
    """MLA's latent is on every GPU whole: two GPUs each load all of it, so tp 2 takes as long as
    tp 1 (a sharded model's tp 2 moves half the bytes per GPU, and is faster)."""
    assert load_s(engine(MLA, 2), tier) == load_s(engine(MLA, 1), tier)
    assert load_s(engine(SHARDED, 2), tier) < load_s(engine(SHARDED, 1), tier)


@pytest.mark.parametrize(("model", "tp"), [(SHARDED, 2), (MLA, 2)])
def test_a_swap_out_at_tp_takes_one_gpus_part_over_one_gpus_host_link(model: str, tp: int) -> None:
    """A swap-out copies every GPU's part of the request's blocks to host over its own host link:
    the host link is busy for what one GPU's part takes on one GPU's link."""
    e = engine(model, tp, swap={"engine": "plain"})
    r = SimRequest(Request(0, 0.0, BLOCKS * BT, 4, tuple(range(BLOCKS))), phase=Phase.RUNNING)
    r.computed_tokens, r.admitted, r.private_blocks = BLOCKS * BT, True, BLOCKS
    e.requests[0], e.private_blocks = r, BLOCKS
    e.running.append(r)
    e.swap_out(r)
    e.loop.run()
    host, _, _ = one_gpu_links()
    part, block_part = gpu_bytes(model, tp, BLOCKS), gpu_bytes(model, tp)
    segment = PLAIN_SWAP.segment_bytes(part, block_part, load_model(model).num_layers)
    expected = host.work_s(part, segment, Direction.OUT)
    assert e.host_link.busy_s()[Direction.OUT] == pytest.approx(expected, rel=1e-12)
    assert e.host_link.bytes_moved[Direction.OUT] == tp * part


@pytest.mark.parametrize(("model", "tp"), [(SHARDED, 2), (SHARDED, 4), (MLA, 2)])
def test_bytes_below_the_device_hold_blocks_of_all_the_engines_gpus(model: str, tp: int) -> None:
    """A host/SSD/remote capacity in bytes holds the blocks whose parts on all tp GPUs fit: for a
    sharded model as many at tp as at tp 1 (a block is the same bytes however split), for MLA tp
    times fewer (a copy per GPU). The automatic host tier is tp GPUs' DRAM shares, so a sharded
    model's grows tp times. HBM stays one GPU's: device blocks count one GPU's part."""
    e, one = engine(model, tp), engine(model, 1)
    block = tp * gpu_bytes(model, tp)
    config = e.config
    assert config.host_blocks == 2**30 // block
    assert config.ssd_blocks == config.remote_blocks == 2**40 // block
    if model == SHARDED:
        assert (config.host_blocks, config.ssd_blocks) == (one.config.host_blocks, one.config.ssd_blocks)
    else:
        assert config.host_blocks == 2**30 // (tp * gpu_bytes(model, 1)) < one.config.host_blocks
    auto = engine(model, tp, host_capacity_bytes="auto").config.host_blocks
    assert auto == int(0.8 * HW.dram_capacity_bytes * tp) // block
    if model == SHARDED:
        auto_one = engine(model, 1, host_capacity_bytes="auto").config.host_blocks
        assert tp * auto_one <= auto < tp * (auto_one + 1)  # tp times, to the block rounding
        # HBM: each GPU holds half the weights and half of each block at tp 2: over twice the blocks.
        hbm = [engine(model, n, device_blocks=None).config.device_blocks for n in (1, tp)]
        assert hbm[1] > tp * hbm[0]


def test_the_pd_hand_off_carries_the_whole_prompts_kv() -> None:
    """P/D: the prefill engine's GPUs each send their part of the prompt's KV over their own
    compute NIC; what crosses is all of it, the same bytes at tp 2 as at tp 1 for a sharded model."""

    def pd_bytes(tp: int) -> float:
        config = SimConfig(
            name="pd",
            tp=tp,
            prefill_engines=1,
            decode_engines=1,
            block_tokens=BT,
            host_capacity_bytes=0,
            workload={"name": "multiturn", "num_sessions": 4, "rate_per_s": 2.0},
        )
        result = run(config)
        assert result["unfinished_requests"] == 0
        return result["links"]["pd"]["bytes_out"]

    assert pd_bytes(2) == pd_bytes(1) > 0


@pytest.mark.parametrize("layout", ["pooled", "serial"])
def test_a_pooled_host_tier_at_tp_is_tp_gpus_shares_of_each_device(layout: str) -> None:
    """With a device pool (kvtier.sim.pool) the engine's host tier holds the blocks whose parts on
    all tp GPUs fit, and a host load takes what one GPU's part takes over one GPU's host link and
    its share of the pool's devices."""
    pool = {"layout": layout, "dram_modules": 2, "passthrough": True}
    tp = 2
    e, one = engine(SHARDED, tp, pool=pool), engine(SHARDED, 1, pool=pool)
    assert e.config.host_blocks == one.config.host_blocks
    host, _, _ = one_gpu_links()
    part, block_part = gpu_bytes(SHARDED, tp, BLOCKS), gpu_bytes(SHARDED, tp)
    layers = load_model(SHARDED).num_layers
    share = build_pool(PoolSpec.from_mapping(pool), HW, EventLoop(), block_part, layers, 1, 1)
    pool_s = share.host_store.work_s(part, block_part, Direction.IN)
    assert load_s(e, Tier.HOST) == pytest.approx(max(host.work_s(part, block_part, Direction.IN), pool_s))
    store = e.host_store_link  # the pool's devices were busy for what one GPU's share is
    assert store is not None
    devices = store.devices if isinstance(store, StripedLink) else [store]
    assert max(d.busy_s()[0] for d in devices) == pytest.approx(pool_s, rel=1e-12)


@pytest.mark.parametrize("fetch", ["bluefield3", "cachegen_gpu"])
def test_a_compressed_fetch_at_tp_takes_one_gpus_part_through_one_gpus_stages(fetch: str) -> None:
    """A compressed fetch from the remote store crosses the storage NIC (compressed), a decoder
    stage (raw) and the host link, all at once: at tp each GPU's part goes through its own share of
    each, its own decoder included, so the fetch takes what one GPU's part takes through them."""
    tp = 2
    e = engine(SHARDED, tp, fetch={"engine": fetch})
    path = e.config.fetch
    rate = path.decoder_bytes_per_s()
    assert rate is not None
    host, _, nic = one_gpu_links()
    part, block_part = gpu_bytes(SHARDED, tp, BLOCKS), gpu_bytes(SHARDED, tp)
    packed = int(part / path.compression_ratio)
    host_bytes = packed if path.decode_on_device else part
    expected = max(
        nic.work_s(packed, block_part, Direction.IN),
        part / rate,
        host.work_s(host_bytes, block_part, Direction.IN),
    )
    landed: list[float] = []
    order = LoadOrder(0, BLOCKS * BT, LoadMode.ASYNC, compressed=True)
    blocks = [(i, Tier.REMOTE) for i in range(BLOCKS)]
    e.start_load_transfers(order, blocks, lambda: landed.append(e.loop.now_s))
    e.loop.run()
    assert landed == [pytest.approx(expected, rel=1e-6)]
