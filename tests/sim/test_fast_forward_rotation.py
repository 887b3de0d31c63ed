"""Decode fast-forward under RotaSched and ``composed`` (issue 20, twelfth slice): the policy keeps
state from the views it is shown (``RotaSched.observe``), and DuplexKV's eager rotation starts host
copies at a slow step's start; neither may differ for the steps planned without the policy."""

from __future__ import annotations

from typing import Any

import pytest

import kvtier.sim.engine as engine_module
from kvtier.bench.sim import config
from kvtier.sched.base import SchedulerDecision, SchedulerView
from kvtier.sched.rotasched import RotaSched
from kvtier.sim.fast_forward import next_step
from kvtier.sim.run import build, workload


def _rota(policy: Any) -> RotaSched:
    rota = policy.rota if hasattr(policy, "rota") else policy
    assert isinstance(rota, RotaSched)
    return rota


def _asked(policy: str, fast_forward: bool) -> dict[tuple[int, str], Any]:
    """Per (engine, instant) the policy was asked: its decision and, after it, what RotaSched
    remembers of every request in the view (all but the sight time)."""
    cfg = config(300, policy, engines=5)
    sim = build(cfg)
    asked: dict[tuple[int, str], Any] = {}
    for i, engine in enumerate(sim.cluster.engines):  # type: ignore[attr-defined]
        engine.decode_fast_forward = fast_forward
        schedule, rota = engine.policy.schedule, _rota(engine.policy)

        def counted(view: SchedulerView, i: int = i, schedule: Any = schedule, rota: RotaSched = rota) -> Any:
            d: SchedulerDecision = schedule(view)
            seen = rota._seen
            ids = [r.req_id for group in (view.running, view.swapped, view.waiting) for r in group]
            remembered = [
                (
                    rid,
                    s.phase,
                    s.generated,
                    s.tokens,
                    s.prev_tokens,
                    repr(s.last_token_s),
                    repr(s.run_start_s),
                )
                for rid in ids
                if (s := seen[rid]) is not None
            ]
            key = (i, repr(view.now_s))
            assert key not in asked
            asked[key] = (d.decode, d.prefill, d.swap_out, d.swap_in, d.preempt, len(d.loads), remembered)
            return d

        engine.policy.schedule = counted
    sim.cluster.feed(workload(cfg))  # type: ignore[attr-defined]
    sim.loop.run(until_s=cfg.max_sim_s)
    assert sim.metrics.requests == 300
    return asked


@pytest.mark.parametrize("policy", ["rotasched", "composed"])
def test_every_step_asked_decides_and_remembers_as_without_the_fast_forward(policy: str) -> None:
    """At every step the fast-forward leaves to the policy, its decision and its records (the
    previous token count of a request that decoded in steps it was not shown among them: eager
    rotation's synced blocks) are those of the replay that asks it at every step."""
    slow = _asked(policy, False)
    fast = _asked(policy, True)
    assert len(fast) < len(slow) / 2, (len(fast), len(slow))
    for key, got in fast.items():
        assert got == slow[key], key


def test_a_block_filled_since_the_last_step_ends_the_run_under_eager_rotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A running request whose newest full block has no eager host copy yet (as after a decode
    that fills it while the request holds a block beyond it) ends the decode run: the slow path's
    step start issues that copy (``Swaps.rotate_synced_blocks``)."""
    cfg = config(300, "rotasched", engines=5)
    sim = build(cfg)
    assert sim.cluster.engines[0].config.swap_copy.eager  # type: ignore[attr-defined]
    probes, ran = [0], [0]

    def checked(engine: Any) -> bool:
        batch = engine.decode_run
        if batch is not None and engine.running:
            r = engine.running[-1]
            r.host_copied_blocks -= 1
            assert not next_step(engine)
            r.host_copied_blocks += 1
            engine.decode_run = batch
            probes[0] += 1
        ok = next_step(engine)
        ran[0] += ok
        return ok

    monkeypatch.setattr(engine_module, "next_step", checked)
    sim.cluster.feed(workload(cfg))  # type: ignore[attr-defined]
    sim.loop.run(until_s=cfg.max_sim_s)
    assert sim.metrics.requests == 300
    assert probes[0] > 1000 and ran[0] > 1000, (probes, ran)
