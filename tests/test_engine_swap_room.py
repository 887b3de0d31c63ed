"""RotaSched on the reference engine (kvtier.engine) with a swap space too small for its rotation.

``SchedulerView.free_host_blocks`` is the host room a swap-out can take (issue 20, eleventh slice):
the engine's ``swap_blocks`` less the slots swapped requests hold (slots a running request keeps
synced by eager rotation give way to a swap-out), as the simulator's ``LowerTiers.swap_room()``.
RotaSched's Algorithm 1 step 4 never picks a victim that room cannot hold, so no swap-out it orders
falls back to recompute in the engine. The correctness oracle is the same requests under ``fcfs``
with ample memory: rotation and recompute must not change greedy tokens.

The engine's clock is replaced by one that advances a fixed step per reading, so RotaSched's VLTs,
and with them its victims, are the same on every run, however loaded the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvtier.engine import Engine, EngineConfig, Model, SamplingParams, Tokenizer
from kvtier.sched import SchedulerDecision, SchedulerView, make_policy
from kvtier.sched.base import Phase
from kvtier.sched.claims import kv_blocks

QUESTIONS = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")
MAX_TOKENS = 8
BLOCK_TOKENS = 8
#: Device blocks: two of the prompts (5 blocks each at 8 tokens) run at once, the third waits.
NUM_BLOCKS = 11
#: Host slots for about one request: RotaSched's rotation would want room for two or more.
SWAP_BLOCKS = 6


@pytest.fixture(scope="module")
def prompts(smollm2: tuple[Model, Tokenizer]) -> list[list[int]]:
    _, tokenizer = smollm2
    return [tokenizer.encode_instruct(q) for q in QUESTIONS]


@dataclass
class Watch:
    """What one run showed and did: per decision, the view's host room, the blocks of the requests
    it swaps out (``kv_blocks``, what the policy counts them as) and the smallest running request's
    blocks; and, per swap-out the engine carried out, whether it kept the KV (False: it fell back
    to recompute)."""

    rooms: list[int | None] = field(default_factory=list)
    swap_out_blocks: list[list[int]] = field(default_factory=list)
    smallest_running: list[int] = field(default_factory=list)
    swapped_out: list[bool] = field(default_factory=list)


def run(
    parts: tuple[Model, Tokenizer], prompts: list[list[int]], policy: str, config: EngineConfig
) -> tuple[Engine, list[list[int]], Watch]:
    """Runs ``prompts`` at once under ``policy``, checking integrity after every step; returns the
    engine, the outputs by prompt and what the watch recorded."""
    model, tokenizer = parts
    engine = Engine(model, make_policy(policy), config)
    clock = [0.0]

    def tick() -> float:  # 50 ms per reading: deterministic VLTs
        clock[0] += 0.05
        return clock[0]

    engine.now_s = tick  # type: ignore[method-assign]
    watch = Watch()
    schedule, swap_out = engine.policy.schedule, engine.swap_out

    def watched_schedule(view: SchedulerView) -> SchedulerDecision:
        decision = schedule(view)
        running = {r.req_id: r for r in view.running}
        watch.rooms.append(view.free_host_blocks)
        watch.swap_out_blocks.append([kv_blocks(running[i], BLOCK_TOKENS) for i in decision.swap_out])
        watch.smallest_running.append(min((kv_blocks(r, BLOCK_TOKENS) for r in view.running), default=0))
        return decision

    def watched_swap_out(r: object) -> None:
        swap_out(r)  # type: ignore[arg-type]
        watch.swapped_out.append(r.phase is Phase.SWAPPED)  # type: ignore[attr-defined]

    engine.policy.schedule = watched_schedule  # type: ignore[method-assign]
    engine.swap_out = watched_swap_out  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ids = [engine.add_request(p, params, tokenizer.stop_token_ids) for p in prompts]
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        outputs.update((o.request_id, o.token_ids) for o in engine.pop_finished())
    assert engine.blocks.private == 0 and engine.swap_used_blocks() == 0
    return engine, [outputs[i] for i in ids], watch


@pytest.fixture(scope="module")
def reference(smollm2: tuple[Model, Tokenizer], prompts: list[list[int]]) -> list[list[int]]:
    """The oracle: ``fcfs`` with ample device memory (no preemption, no swap)."""
    config = EngineConfig(num_blocks=64, block_tokens=BLOCK_TOKENS, swap_blocks=0)
    engine, outputs, _ = run(smollm2, prompts, "fcfs", config)
    assert engine.stats.preemptions == engine.stats.swap_outs == 0
    return outputs


@pytest.mark.parametrize("rotation", [False, True], ids=["", "eager-rotation"])
def test_rotasched_rotates_only_what_the_swap_space_holds(
    smollm2, prompts, reference, rotation: bool
) -> None:
    """A device pool for two of three requests and swap space for one: RotaSched rotates (the
    waiting request's VLT outranks the running ones'), but never orders a swap-out beyond the room
    the view showed, so every swap-out keeps its KV; outputs equal the oracle's. With eager
    rotation, running requests' kept slots fill the swap space and give way to the swap-out."""
    config = EngineConfig(
        num_blocks=NUM_BLOCKS,
        block_tokens=BLOCK_TOKENS,
        max_batch_tokens=64,
        swap_blocks=SWAP_BLOCKS,
        eager_rotation=rotation,
    )
    engine, outputs, watch = run(smollm2, prompts, "rotasched", config)
    assert outputs == reference
    assert any(watch.swap_out_blocks), "RotaSched never rotated: the test misses its path"
    for step, (room, blocks) in enumerate(zip(watch.rooms, watch.swap_out_blocks, strict=True)):
        assert room is not None and sum(blocks) <= room, (step, room, blocks)
    assert watch.swapped_out and all(watch.swapped_out), f"a swap-out fell back to recompute: {watch}"
    # The swap space was full for a running request at some point (it bounded the rotation).
    assert any(room < smallest for room, smallest in zip(watch.rooms, watch.smallest_running, strict=True))
    assert engine.stats.swap_outs == engine.stats.swap_ins == len(watch.swapped_out)
    assert engine.stats.preemptions == 0
    assert (engine.stats.rotated_blocks > 0) == rotation


def test_without_swap_space_the_view_shows_no_room(smollm2, prompts, reference) -> None:
    """``swap_blocks=0``: the view shows 0 host room (not None, "unbounded"), so RotaSched orders no
    swap-out (each would fall back to recompute); the third request waits for blocks instead."""
    config = EngineConfig(
        num_blocks=NUM_BLOCKS, block_tokens=BLOCK_TOKENS, max_batch_tokens=64, swap_blocks=0
    )
    engine, outputs, watch = run(smollm2, prompts, "rotasched", config)
    assert outputs == reference
    assert set(watch.rooms) == {0}
    assert not any(watch.swap_out_blocks) and not watch.swapped_out
    assert engine.stats.swap_outs == 0
