"""What an engine keeps below the device is data-plane config (the sim config's ``offload: {mode}``),
not a policy's: ShadowServe's old ``store_writes`` works for one release with a warning naming the
key, the key reaches the engine (else the policy's paper's engine's, one table in
:mod:`kvtier.sched.data_plane`), bad values are refused naming the key, the old spelling replays
exactly as the new one, and a policy that still sets ``offload`` fails naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.sched import Policy, SchedulerDecision, SchedulerView, make_policy, policy_names
from kvtier.sched.data_plane import default_offload
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.engine import Engine
from kvtier.sim.run import build
from test_load_path import bench, records


def engine(cfg: SimConfig) -> Engine:
    cluster = build(cfg).cluster
    first = cluster.engines[0]
    assert isinstance(first, Engine)
    return first


def test_old_store_writes_moves_to_the_offload_section_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="offload.mode: 'write_through'"):
        new = resolve_deprecated(SimConfig(policy={"name": "shadowserve_async", "store_writes": True}))
    assert (new.policy, new.offload) == ({"name": "shadowserve_async"}, {"mode": "write_through"})
    with pytest.warns(DeprecationWarning, match="offload.mode: 'none'"):
        assert resolve_deprecated(
            SimConfig(policy={"name": "shadowserve_async", "store_writes": False})
        ).offload == {"mode": "none"}
    with pytest.warns(DeprecationWarning):  # the section's own mode wins
        both = SimConfig(policy={"name": "shadowserve_async", "store_writes": True}, offload={"mode": "none"})
        assert resolve_deprecated(both).offload == {"mode": "none"}
    with pytest.raises(ConfigError, match="parameter `store_writes` is 'yes'"):
        resolve_deprecated(SimConfig(policy={"name": "shadowserve_async", "store_writes": "yes"}))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"mode": "lazy"}, "offload `mode` is 'lazy'"),
        ({"when": "evict"}, r"unknown offload key\(s\) \['when'\]"),
        ("write_through", "sim `offload` is 'write_through'"),
    ],
)
def test_bad_offload_sections_are_refused_naming_the_key(section: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig(offload=section)


def test_the_offload_mode_reaches_the_engine_else_the_policys() -> None:
    assert engine(bench({"name": "shadowserve_async"})).offload == "none"  # §6.1: a store others fill
    given = bench({"name": "shadowserve_async"}, offload={"mode": "write_through"})
    assert engine(given).offload == "write_through"
    assert engine(bench({"name": "hicache"})).offload == "write_through"  # its paper's
    assert engine(bench({"name": "hicache"}, offload={"mode": "none"})).offload == "none"
    assert engine(bench({"name": "hicache"}, offload={})).offload == "write_through"


def test_old_store_writes_replays_as_the_offload_mode_and_the_mode_matters() -> None:
    with pytest.warns(DeprecationWarning, match="offload.mode"):
        old = records(bench({"name": "shadowserve_async", "store_writes": True}))
    new = records(bench({"name": "shadowserve_async"}, offload={"mode": "write_through"}))
    assert old == new
    assert new != records(bench({"name": "shadowserve_async"}))  # writing the store changes the hits
    assert records(bench({"name": "hicache"}, offload={"mode": "none"})) != records(
        bench({"name": "hicache"})
    )


def test_the_papers_offload_modes_are_one_data_plane_table() -> None:
    """The modes the policies' papers' engines kept (the ``Policy.offload`` class defaults of
    earlier releases): write-through for LMCache, HiCache, Strata (and their ablations) and
    composed; nothing below the device for the rest."""
    writes = {name for name in policy_names() if default_offload({"name": name}) == "write_through"}
    assert writes == {
        "composed",
        "hicache",
        "lmcache",
        "lmcache_lp",
        "lmcache_lp_async",
        "strata",
        "strata_io",
        "strata_sched",
    }
    assert {default_offload({"name": name}) for name in policy_names()} == {"none", "write_through"}
    for name in policy_names():  # every simulated engine defaults to the table
        engines = build(bench({"name": name})).cluster.engines
        if isinstance(engines, dict):  # DualPath's node groups: KV persists through storage
            continue
        assert {e.offload for e in engines} == {default_offload({"name": name})}, name


def test_a_policy_setting_offload_fails_naming_the_config_key() -> None:
    with pytest.raises(ConfigError, match=r"class Old sets `offload`.*`offload: \{mode: \.\.\.\}`"):

        class Old(Policy):
            name = "test_old_offload"
            offload = "write_through"

            def schedule(self, view: SchedulerView) -> SchedulerDecision:
                return SchedulerDecision()

    policy = make_policy("hicache")
    with pytest.raises(ConfigError, match=r"EngineConfig\.offload"):
        policy.offload = "none"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="policy 'hicache': reading `offload`, which is no longer"):
        _ = policy.offload  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="policy 'fcfs' sets `offload`"):
        make_policy("fcfs", offload="write_through")
