"""The DualPath cluster (kvtier.sim.dualpath): link priority isolation, read paths, end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.sched import make_policy
from kvtier.sched.dualpath import DualPath
from kvtier.sched.kv_io import KvIo
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.core import EventLoop
from kvtier.sim.dualpath import KV_PRIORITY, MODEL_PRIORITY, DualPathCluster
from kvtier.sim.models import load_model
from kvtier.sim.resources import Direction, Link, Transfer
from kvtier.sim.run import build, run


def test_low_priority_kv_traffic_yields_to_model_traffic() -> None:
    """§5.1: with isolation a KV transfer waits while a collective runs; without, they share."""
    for kv_priority, model_done, kv_done in ((1, 1.0, 2.0), (0, 2.0, 2.0)):
        loop = EventLoop()
        link = Link(loop, "cnic", 100.0, 100.0)
        done: dict[str, float] = {}

        def mark(name: str, loop: EventLoop = loop, done: dict[str, float] = done) -> Any:
            def landed(t: Transfer) -> None:
                done[name] = loop.now_s

            return landed

        link.submit(100, Direction.IN, mark("kv"), priority=kv_priority)
        link.submit(100, Direction.IN, mark("model"), priority=0)
        loop.run()
        assert done == pytest.approx({"model": model_done, "kv": kv_done})


def test_deepseek_v32_profile_has_sparse_attention_and_fp8_kv() -> None:
    v32, v3 = load_model("deepseek-v3.2"), load_model("deepseek-v3")
    assert v32.kv_bytes_per_token == (656 + 132) * 61  # FlashMLA FP8 latent + indexer keys, 61 layers
    assert v3.kv_bytes_per_token == 576 * 2 * 61 and v3.index_topk == 0  # unchanged
    long, short = (429, 60_000), (429, 1_000)
    assert v32.attention_flops(*long) < 0.3 * v3.attention_flops(*long)  # top-2048 keys per query
    assert v32.attention_flops(*short) > v3.attention_flops(*short)  # the indexer costs extra when short


def config(policy: str | dict[str, Any], agents: int = 12, turns: float = 6.0, **changes: Any) -> SimConfig:
    spec = policy if isinstance(policy, dict) else {"name": policy}
    base = SimConfig(
        name="dualpath-test",
        hardware="h100-sxm",
        model="deepseek-v3.2",
        policy=spec,
        prefill_engines=8,
        decode_engines=16,
        block_tokens=64,
        workload={
            "name": "agentic",
            "dataset": "64k",
            "arrival": "batch",
            "num_trajectories": agents,
            "turns_mean": turns,
        },
    )
    return base.with_overrides(**changes)


def workload_requests(cfg: SimConfig) -> int:
    from kvtier.sim.run import workload

    return sum(1 for _ in workload(cfg))


def test_dualpath_policies_name_their_global_scheduler_which_needs_node_groups() -> None:
    """The policy's global scheduler (§6.1) picks the cluster: DualPath's runs on PE/DE node
    groups; a router runs any policy on engines; a router cannot drive DualPath's groups."""
    for name in ("dualpath", "dualpath_basic", "dualpath_oracle"):
        assert isinstance(build(config(name)).cluster, DualPathCluster)
    small = {"model": "llama-3.1-8b", "block_tokens": 16}  # fits one GPU without EP
    assert not isinstance(build(config("fcfs", **small)).cluster, DualPathCluster)
    routed = build(config("dualpath", router="least_loaded", **small)).cluster
    assert not isinstance(routed, DualPathCluster)
    with pytest.raises(ConfigError):
        config("dualpath", router="dualpath")


def test_end_to_end_every_turn_finishes_and_hits_its_previous_turn() -> None:
    cfg = config("dualpath", agents=48)  # enough that read queues form: some reads go to DE nodes
    result = run(cfg)
    assert result["requests"] == workload_requests(cfg)
    assert result["unfinished_requests"] == 0
    assert result["hit_rate_tokens"]["remote"] > 0.5  # agentic: most of each prompt is reused
    snics = result["links"]
    assert (
        snics["p0.snic"]["bytes_in"] > 0 and snics["d0.snic"]["bytes_in"] + snics["d1.snic"]["bytes_in"] > 0
    )
    assert result["ttft_s"]["mean"] > 0 and result["ttst_s"]["mean"] > 0
    assert result["bytes_written"] > 0


def test_basic_reads_only_on_prefill_nodes_and_oracle_reads_nothing() -> None:
    basic = run(config("dualpath_basic"))["links"]
    assert basic["p0.snic"]["bytes_in"] > 0
    assert basic["d0.snic"]["bytes_in"] == basic["d1.snic"]["bytes_in"] == 0
    oracle = run(config("dualpath_oracle"))["links"]
    assert all(link["bytes_in"] == 0 for link in oracle.values())


def slow_storage_hardware(tmp_path: Path) -> str:
    """h100-sxm with a storage NIC 100x slower, so short test trajectories are I/O bound (§3)."""
    import yaml

    from kvtier.sim.hardware import HARDWARE_DIR

    data = yaml.safe_load((HARDWARE_DIR / "h100-sxm.yaml").read_text())
    data["name"] = "H100-slow-storage"
    data["storage_nic_bytes_per_s"] = data["storage_nic_bytes_per_s"] / 100
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_dualpath_beats_basic_when_prefill_storage_nics_are_the_bottleneck(tmp_path: Path) -> None:
    """1P2D where the prefill node's storage NIC bounds Basic: DualPath reads through all three
    nodes' NICs (§3, §7.3), and each ablation step helps (Fig. 12's order)."""
    hw = slow_storage_hardware(tmp_path)
    steps = {
        "basic": "dualpath_basic",
        "dual_path": {"name": "dualpath", "read_paths": "dual", "scheduler": "round_robin"},
        "dualpath": "dualpath",
    }
    jct = {k: run(config(p, agents=200, hardware=hw))["makespan_s"] for k, p in steps.items()}
    assert jct["dualpath"] < 0.8 * jct["basic"]
    assert jct["dual_path"] < jct["basic"]


def test_pe_step_traffic_classes_are_isolated_unless_switched_off() -> None:
    for isolation, kv_class in ((True, KV_PRIORITY), (False, MODEL_PRIORITY)):
        policy = make_policy("dualpath")
        assert isinstance(policy, DualPath)
        network = {"traffic_isolation": isolation}  # deployment config, not the policy's
        cluster = DualPathCluster(config("dualpath", prefill_engines=16, network=network), policy)
        r = _ready_request(cluster)
        io = cluster._pe_step_io([(cluster.pes[0], [(r, 100)])])
        classes = {kind: {prio for *_, prio, k in io if k == kind} for kind in ("a2a", "load")}
        assert classes == {"a2a": {MODEL_PRIORITY}, "load": {kv_class}}


def test_the_old_traffic_isolation_parameter_warns_and_sets_the_network_key() -> None:
    old = config({"name": "dualpath_basic", "traffic_isolation": False})
    with pytest.warns(DeprecationWarning, match="network.traffic_isolation: False"):
        new = resolve_deprecated(old)
    assert new.network == {"traffic_isolation": False} and "traffic_isolation" not in new.policy
    assert not new.traffic_isolation and old.traffic_isolation  # the default: isolated
    with pytest.raises(ConfigError, match="traffic_isolation"):
        config("dualpath", network={"traffic_isolation": "yes"})
    with pytest.raises(ConfigError, match="unknown network key"):
        config("dualpath", network={"lanes": 2})


def _ready_request(cluster: DualPathCluster) -> Any:
    from kvtier.sim.gpu_engine import GroupRequest
    from kvtier.sim.request import Request

    req = Request(1, 0.0, 10_000, 10, tuple(range(157)))
    r = GroupRequest(req, hit_tokens=9_600, computed_tokens=9_600, pe=cluster.pes[0].engine_id)
    r.de, r.side = cluster.des[0].engine_id, "de"
    return r


def test_engine_counts_must_fill_whole_nodes() -> None:
    with pytest.raises(ConfigError):
        run(config("dualpath", prefill_engines=12))


def test_quick_reproduction_gives_the_paper_rows(tmp_path: Path) -> None:
    from kvtier.sim import reproduce

    rows = reproduce.run("dualpath", tmp_path, quick=True)
    assert all(row.paper == "dualpath" for row in rows)

    def ratio(fragment: str) -> float:
        [row] = [row for row in rows if fragment in row.metric]
        return row.kvtier_ratio

    # The headlines, DS 660B on 2P4D. §7.3, Fig. 7: DualPath's offline JCT is "up to 1.87x" better than
    # Basic's and close to Oracle's (no KV I/O, the bound). §7.4, Fig. 10: 2.25x Basic's APS capacity
    # at the TTFT SLO. The quick run (96 agents, a 300 s horizon) gives 1.023, 1.036 and 1.52 today:
    # the direction of each, within the paper's figure, with margin below.
    assert 1.005 < ratio("JCT Basic / DualPath") <= 1.87
    assert 1.0 <= ratio("JCT DualPath / Oracle") < 1.1
    assert 1.2 < ratio("APS at TTFT <= 4 s, DualPath / Basic") <= 2.25
    assert (tmp_path / "dualpath_ds660b.png").exists()


def test_ds27b_1p1d_config_runs_and_dualpath_reads_through_both_nodes() -> None:
    """The DS 27B online config (Fig. 10's second model, profile ds-27b on 1P1D): a short horizon
    runs for both systems; Basic reads only through the prefill node's storage NIC, DualPath also
    through the decode node's."""
    from kvtier.sim.reproduce import experiments_dir

    base = SimConfig.from_yaml(experiments_dir() / "dualpath" / "online_ds27b_1p1d.yaml")
    assert load_model(base.model).num_layers == 30
    base = base.with_overrides(max_sim_s=240.0, workload={**base.workload, "rate_per_s": 1.0})
    links = {}
    for system in ("dualpath_basic", "dualpath"):
        result = run(base.with_overrides(policy={"name": system}))
        assert result["requests"] > 0 and result["ttft_s"]["mean"] > 0
        links[system] = result["links"]
    assert set(links["dualpath"]) >= {"p0.snic", "d0.snic"} and "p1.snic" not in links["dualpath"]
    assert links["dualpath_basic"]["p0.snic"]["bytes_in"] > 0
    assert links["dualpath_basic"]["d0.snic"]["bytes_in"] == 0
    assert links["dualpath"]["d0.snic"]["bytes_in"] > 0


# ------------------------------------------------------------------------------------------------
# Layerwise prefill and the Oracle's bypass are data-plane config (the `io` section, kvtier.sched.kv_io)


def test_the_old_layerwise_parameter_warns_and_sets_the_io_key() -> None:
    old = config({"name": "dualpath", "layerwise": False})
    with pytest.warns(DeprecationWarning, match="io.layerwise: False"):
        new = resolve_deprecated(old)
    assert new.io == {"layerwise": False} and "layerwise" not in new.policy
    with pytest.warns(DeprecationWarning):  # the section's own key wins
        assert resolve_deprecated(
            config({"name": "dualpath", "layerwise": False}, io={"layerwise": True})
        ).io == {"layerwise": True}


@pytest.mark.parametrize(
    ("io", "message"),
    [
        ({"layerwise": "no"}, "io `layerwise` is 'no'"),
        ({"bypass": 1}, "io `bypass` is 1"),
        ({"engine": "basic"}, "unknown io engine 'basic'"),
        ({"zero_io": True}, r"unknown io key\(s\) \['zero_io'\]"),
        (True, "sim `io` is True"),
    ],
)
def test_bad_io_sections_are_refused_naming_the_key(io: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config("dualpath", io=io)


def test_a_per_engine_run_refuses_an_io_section() -> None:
    with pytest.raises(ConfigError, match="only the node-group"):
        build(SimConfig(policy={"name": "fcfs"}, io={"layerwise": False}))


def test_the_node_group_cluster_refuses_tp_rather_than_ignoring_it() -> None:
    assert isinstance(build(config("dualpath").with_overrides(tp=1)).cluster, DualPathCluster)
    with pytest.raises(ConfigError, match="sim `tp` is 2, but the node-group"):
        build(config("dualpath").with_overrides(tp=2))


def test_the_io_section_reaches_the_cluster_and_the_policy_view() -> None:
    cluster = build(config("dualpath", io={"layerwise": False})).cluster
    assert isinstance(cluster, DualPathCluster)
    assert not cluster.io.layerwise and not cluster.pes[0].shape.layerwise_prefill
    assert build(config("dualpath_basic")).cluster.io == KvIo(layerwise=False)  # its paper's
    assert build(config("dualpath_oracle")).cluster.io == KvIo(bypass=True)


def simulated(result: Any) -> dict[str, Any]:
    """A run's results without what the host measured or the spelling of its policy."""
    return {
        k: v
        for k, v in result.items()
        if k not in ("wall_s", "cpu_s", "peak_rss_bytes", "policy", "policy_params")
    }


@pytest.mark.parametrize(
    ("ablation", "policy", "io"),
    [
        (
            "dualpath_basic",
            {"name": "dualpath", "read_paths": "pe", "scheduler": "round_robin"},
            {"layerwise": False},
        ),
        ("dualpath_oracle", {"name": "dualpath"}, {"bypass": True}),
    ],
)
def test_an_ablation_as_a_config_difference_runs_as_the_ablation_policy(
    ablation: str, policy: dict[str, Any], io: dict[str, Any]
) -> None:
    want = simulated(run(config(ablation)))
    assert simulated(run(config(policy, io=io))) == want
    assert simulated(run(config(policy))) != want  # the data plane is what differs
    if ablation == "dualpath_basic":  # the old spelling of Basic's layerwise switch, too
        with pytest.warns(DeprecationWarning, match="io.layerwise"):
            assert simulated(run(config({**policy, "layerwise": False}))) == want
