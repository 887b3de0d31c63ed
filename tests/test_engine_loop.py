"""The engine loop (kvtier.engine.scheduler): continuous batching, chunked prefill, the device prefix
cache, preemption by recompute and by swap, all driven by kvtier.sched policies.

The reference for every output is ``greedy_generate`` on a contiguous cache, one prompt at a time:
an independent path (no paged pool, no scheduler). Outputs must be token-identical. Batched and
chunked steps compute the same math in a different order (BLAS blocks differently for different
batch shapes; ~1e-4 on logits of ~30), far below the top-1/top-2 gaps of these prompts.
"""

from __future__ import annotations

import pytest

from kvtier.engine import (
    LLM,
    Engine,
    EngineConfig,
    EngineInputError,
    Model,
    SamplingParams,
    Tokenizer,
    greedy_generate,
    llm_store_config,
)
from kvtier.engine.blocks import BlockManager
from kvtier.engine.errors import EngineError
from kvtier.engine.scheduler import STALLED_STEPS_MAX
from kvtier.sched import Policy, SchedulerDecision, SchedulerView, make_policy, policy_names
from kvtier.sched.batching import admit_fcfs, schedule_running
from kvtier.sched.data_plane import default_offload
from kvtier.store import Store

QUESTIONS = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine_parts(smollm2: tuple[Model, Tokenizer]) -> tuple[Model, Tokenizer]:
    return smollm2


@pytest.fixture(scope="module")
def prompts(engine_parts: tuple[Model, Tokenizer]) -> list[list[int]]:
    _, tokenizer = engine_parts
    return [tokenizer.encode_instruct(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(engine_parts: tuple[Model, Tokenizer], prompts: list[list[int]]) -> list[list[int]]:
    model, tokenizer = engine_parts
    outs = []
    for p in prompts:
        [tokens], _ = greedy_generate(model, [p], MAX_TOKENS, stop_token_ids=tokenizer.stop_token_ids)
        outs.append(tokens)
    return outs


def run(
    parts: tuple[Model, Tokenizer],
    prompts: list[list[int]],
    policy: str | Policy = "fcfs",
    *,
    stagger_steps: int = 0,
    **config: int,
) -> tuple[Engine, dict[int, list[int]]]:
    """Runs the prompts (each ``stagger_steps`` steps after the previous one); outputs by prompt index."""
    model, tokenizer = parts
    engine = Engine(model, make_policy(policy) if isinstance(policy, str) else policy, EngineConfig(**config))
    return engine, drive(engine, tokenizer, prompts, stagger_steps)


def drive(
    engine: Engine, tokenizer: Tokenizer, prompts: list[list[int]], stagger_steps: int = 0
) -> dict[int, list[int]]:
    """Steps ``engine`` through the prompts, checking its integrity after every step; outputs by
    prompt index."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outputs: dict[int, list[int]] = {}
    ids: dict[int, int] = {}
    for i, p in enumerate(prompts):
        ids[engine.add_request(p, params, tokenizer.stop_token_ids)] = i
        for _ in range(stagger_steps):
            engine.step()
            engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        for out in engine.pop_finished():
            outputs[ids[out.request_id]] = out.token_ids
    for out in engine.pop_finished():
        outputs[ids[out.request_id]] = out.token_ids
    engine.check_integrity()
    assert engine.blocks.private == 0, "finished requests left private blocks behind"
    return outputs


def record_swap_outs(engine: Engine) -> list[int]:
    """The swapped request's computed tokens at each of ``engine``'s swap-outs, from now on."""
    computed: list[int] = []
    swap_out = engine.swap_out

    def recording(r: object) -> None:
        computed.append(r.num_computed)  # type: ignore[attr-defined]
        swap_out(r)  # type: ignore[arg-type]

    engine.swap_out = recording  # type: ignore[method-assign]
    return computed


def test_concurrent_requests_match_each_run_alone(engine_parts, prompts, reference) -> None:
    engine, outputs = run(engine_parts, prompts, num_blocks=64)
    assert [outputs[i] for i in range(len(prompts))] == reference
    # All three were batched: one prefill step for all of them, then shared decode steps.
    assert engine.stats.steps <= MAX_TOKENS + 1


def test_requests_joining_mid_flight_match_each_run_alone(engine_parts, prompts, reference) -> None:
    """Continuous batching: a request arriving while others decode joins the next step (a prefill
    chunk next to decode tokens in one forward pass)."""
    engine, outputs = run(engine_parts, prompts, stagger_steps=2, num_blocks=64, max_batch_tokens=24)
    assert [outputs[i] for i in range(len(prompts))] == reference
    assert engine.stats.steps < 3 * (MAX_TOKENS + 2), "requests ran one after another, not batched"


def test_chunked_prefill_matches_whole_prefill(engine_parts, prompts, reference) -> None:
    engine, outputs = run(engine_parts, prompts[:1], num_blocks=64, max_batch_tokens=8)
    assert outputs[0] == reference[0]
    # 37 prompt tokens in chunks of 8: five prefill steps, then one decode step per further token.
    assert engine.stats.steps == -(-len(prompts[0]) // 8) + len(reference[0]) - 1


def test_device_prefix_cache_serves_a_repeated_prompt(engine_parts, prompts, reference) -> None:
    model, tokenizer = engine_parts
    engine = Engine(model, make_policy("fcfs"), EngineConfig(num_blocks=64, block_tokens=8))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine.add_request(prompts[0], params, tokenizer.stop_token_ids)
    [first] = engine.run()
    prefilled = engine.stats.prefill_tokens
    engine.add_request(prompts[0], params, tokenizer.stop_token_ids)
    [second] = engine.run()
    assert first.token_ids == second.token_ids == reference[0]
    assert first.cached_tokens["device"] == 0
    # Prompt and output blocks were cached; at least one prompt token is always computed.
    assert second.cached_tokens["device"] == (len(prompts[0]) - 1) // 8 * 8
    assert engine.stats.prefill_tokens - prefilled == len(prompts[0]) - second.cached_tokens["device"]
    engine.check_integrity()


def test_preemption_by_recompute_keeps_outputs(engine_parts, prompts, reference) -> None:
    """A pool that holds two prompts but not their outputs: running requests preempt each other
    (vLLM's passive preemption, most recently admitted first) and recompute prompt + output later."""
    engine, outputs = run(engine_parts, prompts, num_blocks=11, block_tokens=8, swap_blocks=0)
    assert [outputs[i] for i in range(len(prompts))] == reference
    assert engine.stats.preemptions > 0
    assert engine.stats.swap_outs == 0


@pytest.mark.parametrize("policy", ["swapped_first", "waiting_first"])
@pytest.mark.parametrize("rotation", [False, True], ids=["", "eager-rotation"])
def test_preemption_by_swap_keeps_outputs(
    engine_parts, prompts, reference, policy: str, rotation: bool
) -> None:
    engine, outputs = run(
        engine_parts,
        prompts,
        policy,
        num_blocks=9,
        block_tokens=8,
        max_batch_tokens=64,
        eager_rotation=rotation,
    )
    assert [outputs[i] for i in range(len(prompts))] == reference
    assert engine.stats.swap_outs > 0
    assert engine.stats.swap_ins == engine.stats.swap_outs
    assert (engine.stats.rotated_blocks > 0) == rotation


def test_eager_rotation_leaves_only_the_tail_to_copy_at_preemption(engine_parts, prompts, reference) -> None:
    """SuperInfer's eager block rotation: full blocks are copied out in the background while the
    request runs, so preempting it by swap copies only its partial tail block."""
    model, tokenizer = engine_parts
    engine = Engine(
        model, _Scripted("swap"), EngineConfig(num_blocks=64, block_tokens=8, eager_rotation=True)
    )
    computed = record_swap_outs(engine)
    outputs = drive(engine, tokenizer, prompts[:2])
    assert [outputs[0], outputs[1]] == reference[:2]
    [n] = computed
    held, full = -(-n // 8), n // 8
    assert full >= 3 and engine.stats.rotated_blocks >= full
    assert engine.stats.swap_out_blocks_copied == held - full, (n, engine.stats)
    assert engine.swap_used_blocks() == 0


def test_engine_flags_must_be_bools() -> None:
    with pytest.raises(EngineInputError, match="eager_rotation"):
        EngineConfig(eager_rotation=1)  # type: ignore[arg-type]
    with pytest.raises(EngineInputError, match=r"engine `offload` is 'lazy'; expected one of \['none'"):
        EngineConfig(offload="lazy")


@pytest.mark.parametrize(
    ("policy", "offload", "mode"),
    [
        ("fcfs", None, "none"),  # vLLM's GPU prefix cache
        ("fcfs", "write_through", "write_through"),
        ("lmcache", None, "write_through"),  # its paper's engine's (kvtier.sched.data_plane)
        ("lmcache", "none", "none"),
    ],
)
def test_offload_is_engine_config_else_the_policys_papers(
    engine_parts, prompts, policy: str, offload: str | None, mode: str
) -> None:
    """What the engine keeps below the device is ``EngineConfig.offload``, else the policy's paper's
    engine's: write-through saves the prompt's blocks once prefilled, before the request finishes."""
    model, tokenizer = engine_parts
    store = Store(llm_store_config(8, dram={"capacity_bytes": 64 << 20}))
    config = EngineConfig(num_blocks=64, block_tokens=8, offload=offload)
    llm = LLM(model=model, tokenizer=tokenizer, config=config, store=store, policy=policy)
    llm.engine.add_request(prompts[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    llm.engine.step()  # the whole prompt prefills; its first token is sampled
    assert llm.engine.offload == mode and llm.engine.has_unfinished()
    assert llm.engine.stats.saved_blocks == (len(prompts[0]) // 8 if mode == "write_through" else 0)


class _Scripted(Policy):
    """FCFS, plus a scripted swap-out / preemption of request 0 after it decoded ``after`` tokens,
    and its swap-in ``hold`` steps later."""

    name = "test_scripted"

    def __init__(self, action: str, after: int = 3, hold: int = 2) -> None:
        self.action, self.after, self.hold = action, after, hold
        self.done = False
        self.held = 0

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        target = next((r for r in view.running if r.req_id == 0 and r.generated_tokens >= self.after), None)
        if target is not None and not self.done:
            self.done = True
            (decision.swap_out if self.action == "swap" else decision.preempt).append(0)
            view = _without(view, 0)
        elif view.swapped:
            self.held += 1
            if self.held > self.hold:
                decision.swap_in.extend(r.req_id for r in view.swapped)
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=None)
        return decision


def _without(view: SchedulerView, req_id: int) -> SchedulerView:
    from dataclasses import replace

    return replace(view, running=tuple(r for r in view.running if r.req_id != req_id))


@pytest.mark.parametrize("action", ["swap", "recompute"])
def test_scripted_swap_and_recompute_keep_outputs(engine_parts, prompts, reference, action: str) -> None:
    policy = _Scripted(action)
    engine, outputs = run(engine_parts, prompts[:2], policy, num_blocks=64)
    assert policy.done
    assert [outputs[0], outputs[1]] == reference[:2]
    if action == "swap":
        assert (engine.stats.swap_outs, engine.stats.swap_ins, engine.stats.preemptions) == (1, 1, 0)
    else:
        assert (engine.stats.swap_outs, engine.stats.preemptions) == (0, 1)


def test_swap_out_without_host_room_falls_back_to_recompute(engine_parts, prompts, reference) -> None:
    engine, outputs = run(engine_parts, prompts[:2], _Scripted("swap"), num_blocks=64, swap_blocks=1)
    assert [outputs[0], outputs[1]] == reference[:2]
    assert (engine.stats.swap_outs, engine.stats.preemptions) == (0, 1)


class _SwapBoth(Policy):
    """FCFS; once requests 0 and 1 both decoded ``after`` tokens, swaps both out in one step
    and, the next step, both in together."""

    name = "test_swap_both"

    def __init__(self, after: int = 2) -> None:
        self.after = after
        self.swapped_out = self.swapped_in = False

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        ready = [r for r in view.running if r.req_id in (0, 1) and r.generated_tokens >= self.after]
        if len(ready) == 2 and not self.swapped_out:
            self.swapped_out = True
            decision.swap_out.extend([0, 1])
            view = _without(_without(view, 0), 1)
        elif len(view.swapped) == 2:
            self.swapped_in = True
            decision.swap_in.extend([0, 1])
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=None)
        return decision


def test_two_requests_sharing_prefix_blocks_swap_out_and_in_together(
    engine_parts, prompts, reference
) -> None:
    """The same prompt twice: the second request reuses the first one's full blocks from the device
    prefix cache, so one step swaps out blocks that two requests share (each gets its own host
    copy), and one step swaps both back into fresh blocks: outputs stay token-identical."""
    model, tokenizer = engine_parts
    policy = _SwapBoth()
    engine = Engine(model, policy, EngineConfig(num_blocks=64, block_tokens=8))
    assert engine.duplex is not None
    copied: list[tuple[int, int]] = []
    swap_out = engine.duplex.swap_out
    engine.duplex.swap_out = lambda block, slot: copied.append((block, slot)) or swap_out(block, slot)  # type: ignore[method-assign]
    # One step between the two: request 0's prompt is prefilled and its full blocks are cached.
    outputs = drive(engine, tokenizer, [prompts[2], prompts[2]], stagger_steps=1)
    assert policy.swapped_out and policy.swapped_in
    assert engine.stats.swap_outs == 2 and engine.stats.swap_ins == 2
    blocks = [b for b, _ in copied]
    assert len(set(blocks)) < len(blocks), f"no shared block was swapped out: {copied}"
    assert len({s for _, s in copied}) == len(copied), "each copy has its own host slot"
    assert outputs[0] == outputs[1] == reference[2]
    assert engine.swap_used_blocks() == 0


class _SwapOutAndIn(Policy):
    """FCFS; swaps request 1 out once it decoded 2 tokens, then, once request 0 decoded 4, swaps
    request 0 out and request 1 back in in the same step, then request 0 back in."""

    name = "test_swap_out_and_in"

    def __init__(self) -> None:
        self.phase = 0

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        running = {r.req_id: r for r in view.running}
        if self.phase == 0 and 0 in running and 1 in running and running[1].generated_tokens >= 2:
            decision.swap_out.append(1)
            view, self.phase = _without(view, 1), 1
        elif self.phase == 1 and 0 in running and running[0].generated_tokens >= 4:
            decision.swap_out.append(0)
            decision.swap_in.append(1)
            view, self.phase = _without(view, 0), 2
        elif self.phase == 2 and view.swapped:
            decision.swap_in.extend(r.req_id for r in view.swapped)
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=None)
        return decision


def test_swap_in_into_blocks_a_same_step_swap_out_frees(engine_parts, prompts, reference) -> None:
    """A pool so small that request 1's swap-in gets blocks request 0's swap-out frees in the same
    step: the DuplexEngine orders the copy-in after the copy-out's read; outputs stay identical."""
    model, tokenizer = engine_parts
    config = EngineConfig(num_blocks=15, block_tokens=8, max_batch_tokens=128, device_prefix_cache=False)
    engine = Engine(model, _SwapOutAndIn(), config)
    assert engine.duplex is not None
    duplex = engine.duplex
    step: dict[str, list[int]] = {"out": [], "in": []}
    steps: list[tuple[set[int], set[int]]] = []
    swap_out, swap_in, submit = duplex.swap_out, duplex.swap_in, duplex.submit_step
    duplex.swap_out = lambda b, s: step["out"].append(b) or swap_out(b, s)  # type: ignore[method-assign]
    duplex.swap_in = lambda s, b: step["in"].append(b) or swap_in(s, b)  # type: ignore[method-assign]

    def submit_step() -> tuple[int | None, int | None]:
        steps.append((set(step["out"]), set(step["in"])))
        step["out"].clear()
        step["in"].clear()
        return submit()

    duplex.submit_step = submit_step  # type: ignore[method-assign]
    outputs = drive(engine, tokenizer, prompts)
    assert [outputs[i] for i in range(3)] == reference
    assert engine.stats.swap_outs == engine.stats.swap_ins == 2
    assert any(out & into for out, into in steps), f"no block reused in its step: {steps}"
    assert engine.swap_used_blocks() == 0


class _SwapTwice(Policy):
    """FCFS; swaps request 0 out after it decoded 2 tokens and back in the next step, twice."""

    name = "test_swap_twice"

    def __init__(self) -> None:
        self.outs = 0
        self.held: list[int] = []  # request 0's blocks at each swap-out

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        target = next((r for r in view.running if r.req_id == 0), None)
        if target is not None and self.outs < 2 and target.generated_tokens >= 2 + 3 * self.outs:
            self.outs += 1
            decision.swap_out.append(0)
            view = _without(view, 0)
        elif view.swapped:
            decision.swap_in.extend(r.req_id for r in view.swapped)
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=None)
        return decision


def test_a_second_swap_out_copies_only_blocks_written_since_the_swap_in(
    engine_parts, prompts, reference
) -> None:
    """A swapped-in request keeps the host slots of its full blocks (KV is append-only: they stay
    synced), so swapping it out again copies only its newer blocks; outputs stay identical."""
    model, tokenizer = engine_parts
    policy = _SwapTwice()
    engine = Engine(model, policy, EngineConfig(num_blocks=64, block_tokens=8))
    computed = record_swap_outs(engine)  # request 0's computed tokens at each swap-out
    outputs = drive(engine, tokenizer, prompts[:2])
    assert [outputs[0], outputs[1]] == reference[:2]
    assert engine.stats.swap_outs == engine.stats.swap_ins == 2
    held = [-(-n // 8) for n in computed]
    full_at_swap_in = computed[0] // 8  # kept synced: the second swap-out does not copy them
    assert 0 < full_at_swap_in < held[1]
    assert engine.stats.swap_out_blocks_copied == held[0] + held[1] - full_at_swap_in, computed
    assert engine.swap_used_blocks() == 0


class _Never(Policy):
    name = "test_never"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        return SchedulerDecision()


def test_an_engine_that_cannot_progress_raises_instead_of_hanging(engine_parts, prompts) -> None:
    model, tokenizer = engine_parts
    engine = Engine(model, _Never(), EngineConfig(num_blocks=16))
    engine.add_request(prompts[0], SamplingParams(max_tokens=2), tokenizer.stop_token_ids)
    with pytest.raises(EngineError, match=r"no progress for \d+ steps"):
        engine.run()
    assert engine.stats.steps == 0
    assert STALLED_STEPS_MAX >= 1


def test_bad_requests_are_refused_when_added(engine_parts, prompts) -> None:
    model, _ = engine_parts
    engine = Engine(model, make_policy("fcfs"), EngineConfig(num_blocks=4, block_tokens=16))
    params = SamplingParams(max_tokens=8)
    with pytest.raises(EngineInputError, match="prompt is empty"):
        engine.add_request([], params)
    with pytest.raises(EngineInputError, match=r"context is 8192 tokens"):
        engine.add_request([1] * 8192, params)
    with pytest.raises(EngineInputError, match=r"token ids must be in 0\.\.49151"):
        engine.add_request([49152], params)
    with pytest.raises(EngineInputError, match=r"KV pool has 4 blocks of 16 tokens .* needs 5"):
        engine.add_request([1] * 60, params)
    with pytest.raises(EngineInputError, match="offload 'write_through' writes KV to a lower tier"):
        Engine(model, make_policy("lmcache"), EngineConfig())  # its paper's engine writes through
    with pytest.raises(EngineInputError, match=r"offload 'write_back' .* no store"):
        Engine(model, make_policy("fcfs"), EngineConfig(offload="write_back"))
    assert Engine(model, make_policy("lmcache"), EngineConfig(offload="none")).offload == "none"
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def warm_store(engine_parts, prompts) -> Store:
    """A store already holding the prompts' blocks (8-token blocks), from an earlier engine."""
    model, tokenizer = engine_parts
    store = Store(llm_store_config(8, dram={"capacity_bytes": "64MiB"}))
    llm = LLM(
        model=model, tokenizer=tokenizer, config=EngineConfig(num_blocks=64, block_tokens=8), store=store
    )
    llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return store


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("rotation", [False, True], ids=["", "eager-rotation"])
def test_every_registered_policy_drives_the_engine(
    engine_parts, prompts, reference, warm_store, policy: str, rotation: bool
) -> None:
    """The simulator's policy objects, unchanged, on real KV: a small pool (chunked prefills,
    admission limits), a warm store below it; outputs identical to the reference. With and without
    eager rotation (which also runs beside the loads from the store)."""
    model, tokenizer = engine_parts
    config = EngineConfig(num_blocks=12, block_tokens=8, max_batch_tokens=32, eager_rotation=rotation)
    llm = LLM(model=model, tokenizer=tokenizer, config=config, store=warm_store, policy=policy)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == reference
    llm.engine.check_integrity()
    if default_offload({"name": policy}) != "none":
        assert llm.engine.stats.loaded_blocks > 0, (
            "a policy with a lower tier never loaded from the warm store"
        )


def test_block_manager_caches_shares_and_evicts_lru() -> None:
    blocks = BlockManager(6)
    a = blocks.allocate(3)
    assert a == [0, 1, 2]
    assert blocks.commit([11, 12], a, 0) == [True, True]  # blocks 0, 1 cached under keys 11, 12
    b = blocks.allocate(2)
    assert b is not None
    assert blocks.commit([11, 21], [b[0], b[1]], 0) == [False, True]  # 11 was cached first
    assert blocks.match([11, 12, 13]) == [0, 1]
    assert blocks.cached_prefix([11, 21]) == 2
    blocks.check_integrity()
    assert blocks.allocate(2) is None  # 1 free, everything cached is locked
    blocks.unlock([11, 12])
    blocks.free_private([2])
    assert blocks.available() == 3  # free block 2 + 5, plus key 12's block (unlocked)
    c = blocks.allocate(3)
    assert c is not None and sorted(c) == [1, 2, 5]  # evicted key 12, kept 11 (still locked via 21)
    assert blocks.cached_prefix([11, 12]) == 1
    blocks.check_integrity()


def test_without_device_prefix_cache_finished_blocks_leave(engine_parts, prompts, reference) -> None:
    model, tokenizer = engine_parts
    engine = Engine(model, make_policy("fcfs"), EngineConfig(num_blocks=64, device_prefix_cache=False))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for _ in range(2):
        engine.add_request(prompts[0], params, tokenizer.stop_token_ids)
        [out] = engine.run()
        assert out.token_ids == reference[0]
        assert out.cached_tokens["device"] == 0
    assert engine.blocks.available() == len(engine.blocks.free) == 64
