"""The copies a load crosses the host link in are data-plane config (the sim config's ``load``
section, :mod:`kvtier.sched.load_path`), not a policy's: the old policy keys still work for one
release and warn naming the new key, the new key reaches the engine, bad values are refused naming
the key, and Strata's Fig. 9 ablations as config differences replay exactly as the ablation
policies do."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.bench.sim import config as bench_config
from kvtier.errors import ConfigError
from kvtier.sched.base import LoadMode
from kvtier.sched.load_path import LOAD_ENGINES, LoadPath, load_path
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.run import build, workload

REQUESTS = 160


def records(cfg: SimConfig) -> list[tuple[Any, ...]]:
    """Every finished request's arrival, first token, finish and hits, in finish order."""
    sim = build(cfg)
    out: list[tuple[Any, ...]] = []
    add = sim.metrics.add_request

    def record(r: RequestRecord) -> None:
        out.append((r.arrival_s, r.first_token_s, r.finish_s, tuple(r.hit_tokens)))
        add(r)

    sim.metrics.add_request = record  # type: ignore[method-assign]
    sim.cluster.feed(workload(cfg))
    sim.loop.run(until_s=cfg.max_sim_s)
    assert len(out) == REQUESTS
    return out


def bench(policy: dict[str, Any], **changes: Any) -> SimConfig:
    return bench_config(REQUESTS, str(policy["name"])).with_overrides(policy=policy, **changes)


def test_the_paths_price_copies_as_their_papers_measured() -> None:
    page, kernel, plain = (LOAD_ENGINES[n] for n in ("per_page", "gpu_kernel", "plain"))
    assert page.segment_tokens(LoadMode.LAYERWISE, 4096) == 32 and page.slowdown(LoadMode.LAYERWISE) == 0
    assert kernel.segment_tokens(LoadMode.LAYERWISE, 4096) == 4096  # one kernel per layer
    assert kernel.segment_tokens(LoadMode.ASYNC, 4096) is None  # whole page-first objects
    assert (kernel.slowdown(LoadMode.LAYERWISE), kernel.slowdown(LoadMode.ASYNC)) == (0.05, 0.10)
    assert plain.segment_tokens(LoadMode.LAYERWISE, 4096) is None and plain.slowdown(LoadMode.ASYNC) == 0


def test_a_section_names_an_engine_and_changes_its_keys() -> None:
    assert load_path(None, "per_page") == LOAD_ENGINES["per_page"]
    assert load_path({"page_tokens": 16}, "per_page") == LoadPath(copy="page", page_tokens=16)
    assert load_path({"engine": "gpu_kernel"}, "per_page") == LOAD_ENGINES["gpu_kernel"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"engine": "dma"}, "unknown load engine 'dma'"),
        ({"engine": 3}, "load `engine` is 3"),
        ({"page_tokens": 0}, "load `page_tokens` is 0"),
        ({"page_tokens": 8.5}, "load `page_tokens` is 8.5"),
        ({"copy": "block"}, "load `copy` is 'block'"),
        ({"interference": -0.1}, "load `interference` is -0.1"),
        ({"layerwise_interference": True}, "load `layerwise_interference` is True"),
        ({"pages": 32}, r"unknown load key\(s\) \['pages'\]"),
        ("per_page", "sim `load` is 'per_page'"),
    ],
)
def test_bad_load_sections_are_refused_naming_the_key(section: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig(load=section)


def test_old_copy_parameters_move_to_the_load_section_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="load.page_tokens: 16"):
        new = resolve_deprecated(SimConfig(policy={"name": "hicache", "page_tokens": 16}))
    assert (new.policy, new.load) == ({"name": "hicache"}, {"page_tokens": 16})
    with pytest.warns(DeprecationWarning, match="load.engine: 'per_page'"):
        new = resolve_deprecated(SimConfig(policy={"name": "strata", "io": "page", "defer": False}))
    assert (new.policy, new.load) == ({"name": "strata", "defer": False}, {"engine": "per_page"})
    with pytest.warns(DeprecationWarning, match="load.engine: 'gpu_kernel'"):
        new = resolve_deprecated(
            SimConfig(policy={"name": "composed", "stages": ["balance"], "strata": {"io": "gpu"}})
        )
    assert new.policy["strata"] == {} and new.load == {"engine": "gpu_kernel"}
    # The section's own keys win; other policies' parameters and plain configs are left alone.
    with pytest.warns(DeprecationWarning):
        both = SimConfig(policy={"name": "hicache", "page_tokens": 16}, load={"page_tokens": 64})
        assert resolve_deprecated(both).load == {"page_tokens": 64}
    plain = SimConfig(policy={"name": "lmcache"}, load={"engine": "per_page"})
    assert resolve_deprecated(plain) is plain
    with pytest.raises(ConfigError, match="parameter `io` is 'dma'"):
        resolve_deprecated(SimConfig(policy={"name": "strata", "io": "dma"}))


def test_the_load_section_reaches_the_engine() -> None:
    default = build(bench({"name": "hicache"}))
    assert default.cluster.engines[0].config.load == LOAD_ENGINES["per_page"]  # its paper's
    given = build(bench({"name": "hicache"}, load={"page_tokens": 16}))
    assert given.cluster.engines[0].config.load == LoadPath(copy="page", page_tokens=16)
    assert build(bench({"name": "lmcache"})).cluster.engines[0].config.load == LOAD_ENGINES["plain"]


def test_old_and_new_page_tokens_replay_the_same_and_the_key_matters() -> None:
    with pytest.warns(DeprecationWarning, match="load.page_tokens"):
        old = records(bench({"name": "hicache", "page_tokens": 256}))
    new = records(bench({"name": "hicache"}, load={"page_tokens": 256}))
    assert old == new
    assert new != records(bench({"name": "hicache"}))  # 32-token pages copy slower


@pytest.mark.parametrize(
    ("ablation", "policy", "load"),
    [("strata_sched", "strata", "per_page"), ("strata_io", "hicache", "gpu_kernel")],
)
def test_an_ablation_as_a_config_difference_replays_the_ablation_policy(
    ablation: str, policy: str, load: str
) -> None:
    want = records(bench({"name": ablation}))
    assert records(bench({"name": policy}, load={"engine": load})) == want
    assert records(bench({"name": policy})) != want  # the data plane is what the ablation changes


# ------------------------------------------------------------------------------------------------
# LMCache's chunk: its object size is the config's block_tokens (the plain path moves objects whole)


@pytest.mark.parametrize("policy", ["lmcache", "lmcache_lp", "lmcache_lp_async", "unified_pool"])
def test_old_chunk_tokens_is_dropped_with_a_warning_naming_block_tokens(policy: str) -> None:
    old = SimConfig(policy={"name": policy, "chunk_tokens": 256}, block_tokens=256)
    with pytest.warns(DeprecationWarning, match=r"chunk_tokens.*block_tokens \(256"):
        new = resolve_deprecated(old)
    assert "chunk_tokens" not in new.policy and new.block_tokens == 256


def test_a_bad_chunk_tokens_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="parameter `chunk_tokens` is 0"):
        resolve_deprecated(SimConfig(policy={"name": "lmcache", "chunk_tokens": 0}))
    with pytest.raises(ConfigError, match="`block_tokens` is 0"):
        SimConfig(policy={"name": "lmcache"}, block_tokens=0)


def test_old_chunk_tokens_replays_as_block_tokens_alone() -> None:
    with pytest.warns(DeprecationWarning, match="block_tokens"):
        old = records(bench({"name": "lmcache_lp", "chunk_tokens": 128}))
    assert old == records(bench({"name": "lmcache_lp"}))  # it never reached the engine
