"""RotaSched's transfer budget B_xfer carried to a node (kvtier.sim.xfer, SuperInfer §5.1): the
simulator fills the node's time-equal budget where a config leaves it out, and a policy built
outside the simulator takes §5.1's 38,400 tokens in its view's blocks, never 2400 blocks of any size."""

from __future__ import annotations

import pytest

from kvtier.bench.sim import config as bench_config
from kvtier.errors import ConfigError
from kvtier.sched.base import LoadMode, Phase, RequestView, SchedulerView
from kvtier.sched.composed import Composed
from kvtier.sched.rotasched import PAPER_XFER_BLOCKS, RotaSched, paper_xfer_blocks
from kvtier.sched.swap_copy import SWAP_ENGINES
from kvtier.sim.config import SimConfig
from kvtier.sim.run import build
from kvtier.sim.xfer import xfer_blocks
from kvtier.tiers import Tier


def test_the_papers_own_node_gets_the_papers_budget() -> None:
    # §5.1's node (GH200, Qwen2.5-32B, 16-token blocks): both translations give back 2400; the
    # time-equal one reads both sides at their both-ways rate (a lone direction on one side only
    # would give 2400 / 0.755 = 3178).
    paper = SimConfig(
        name="paper",
        hardware="gh200",
        model="qwen2.5-32b",
        policy={"name": "rotasched"},
        block_tokens=16,
        workload={"name": "mooncake"},
    )
    assert xfer_blocks(paper) == (PAPER_XFER_BLOCKS, PAPER_XFER_BLOCKS)
    # Twice the GPUs per engine (tp 2): twice the host links, twice the blocks in the same time.
    time_equal = xfer_blocks(paper.with_overrides(tp=2, model="llama-3.1-70b"))[0]
    assert time_equal == 2 * xfer_blocks(paper.with_overrides(model="llama-3.1-70b"))[0]


def _policies(cfg: SimConfig) -> list[object]:
    return [e.policy for e in build(cfg).cluster.engines]


def test_the_simulator_fills_the_nodes_budget_where_the_config_leaves_it_out() -> None:
    cfg = bench_config(40, "rotasched", engines=2)  # h100-sxm, Llama-3.1-8B, 512-token blocks
    time_equal, token_equal = xfer_blocks(cfg)
    assert (time_equal, token_equal) == (36, 75)
    assert [p.xfer_blocks for p in _policies(cfg)] == [time_equal, time_equal]  # type: ignore[attr-defined]
    own = cfg.with_overrides(policy={"name": "rotasched", "xfer_blocks": 7})
    assert [p.xfer_blocks for p in _policies(own)] == [7, 7]  # type: ignore[attr-defined]
    composed = bench_config(40, "composed")
    assert [p.rota.xfer_blocks for p in _policies(composed)] == [time_equal]  # type: ignore[attr-defined]
    assert build(bench_config(40, "fcfs")).cluster.engines  # a policy without a budget gets none


class _NoCost:
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 0.0

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        return 0.0


def _view(requests: list[RequestView], block_tokens: int) -> SchedulerView:
    by = {p: tuple(r for r in requests if r.phase is p) for p in Phase}
    return SchedulerView(
        now_s=10.0,
        waiting=by[Phase.WAITING],
        running=by[Phase.RUNNING],
        fetching=(),
        swapped=by[Phase.SWAPPED],
        free_device_blocks=0,
        free_host_blocks=None,
        block_tokens=block_tokens,
        max_batch_tokens=8192,
        max_running=256,
        num_layers=32,
        cost=_NoCost(),
        swap_copy=SWAP_ENGINES["duplexkv"],
    )


def test_a_policy_built_alone_takes_the_papers_tokens_in_its_blocks() -> None:
    assert [paper_xfer_blocks(bt) for bt in (16, 64, 512, 10**6)] == [2400, 600, 75, 1]
    # At 512-token blocks, two long-waiting requests of 50 blocks each (25,600 tokens) and no free
    # block: §5.1's 38,400 tokens (75 blocks) bring in one of them, 2400 blocks would bring both.
    tokens = 50 * 512
    requests = [
        RequestView(1, 0.0, Phase.WAITING, tokens, 0, 0),
        RequestView(2, 0.1, Phase.WAITING, tokens, 0, 0),
        RequestView(3, 9.0, Phase.RUNNING, tokens, tokens, 3),
        RequestView(4, 9.1, Phase.RUNNING, tokens, tokens, 3),
        RequestView(5, 9.2, Phase.RUNNING, tokens, tokens, 3),
    ]
    view = _view(requests, 512)
    for policy, admitted in (
        (RotaSched(), [1]),
        (RotaSched(xfer_blocks=75), [1]),
        (RotaSched(xfer_blocks=2400), [1, 2]),
    ):
        policy.observe(_view(requests, 512))
        _, prioritised, _ = policy.rotate(view)
        assert [r.req_id for r in prioritised] == admitted, policy.xfer_blocks
    assert Composed().rota.xfer_blocks is None  # the same default, resolved at its first view
    for bad in (-1, 2.5, True, "36"):
        with pytest.raises(ConfigError, match="xfer_blocks"):
            RotaSched(xfer_blocks=bad)  # type: ignore[arg-type]


def test_a_run_reports_the_budget_it_filled_in() -> None:
    from kvtier.report import sim_summary
    from kvtier.sim.run import run

    result = run(bench_config(8, "rotasched"))
    assert result["policy"] == {"name": "rotasched"}  # the config, as written
    assert result["policy_params"]["xfer_blocks"] == 36 and result["policy_params"]["name"] == "rotasched"
    assert "policy defaults: ttft_slo_s 5.0, tbt_slo_s 0.1, alpha 3.0" in sim_summary(result)
    assert "xfer_blocks 36" in sim_summary(result)
    own = run(bench_config(8, "fcfs"))
    assert own["policy_params"] == {"name": "fcfs"} and "policy defaults" not in sim_summary(own)
