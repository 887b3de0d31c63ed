"""DualPath's scheduler (kvtier.sched.dualpath) on hand-built engine reports and views (§6)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.errors import ConfigError
from kvtier.sched import make_policy
from kvtier.sched.base import LoadMode, Phase, RequestView, SchedulerView
from kvtier.sched.dualpath import (
    Category,
    DualPath,
    EngineLoad,
    PendingRequest,
    assign_de_groups,
    choose_read_path,
    pack_compute_quota,
    pe_category,
    schedule_de_group,
    schedule_pe_fetch,
)
from kvtier.tiers import Tier

SHORT_Q = 1_000  # alpha in tokens
LIMIT = 10_000  # beta in tokens


def pe(engine_id: int, tokens: int, queue: int, requests: int = 0) -> EngineLoad:
    return EngineLoad(engine_id, 0, requests, tokens, queue)


def req(req_id: int, tokens: int) -> PendingRequest:
    return PendingRequest(req_id, tokens, tokens - 1)


# Inter-engine: PE categories and fetch (§6.1) ----------------------------------------------------


def test_pe_categories_follow_the_three_cases_at_their_boundaries() -> None:
    assert pe_category(pe(0, LIMIT + 1, 0), SHORT_Q, LIMIT) is Category.OVERLOADED
    assert pe_category(pe(0, LIMIT, SHORT_Q), SHORT_Q, LIMIT) is Category.SHORT_QUEUE
    assert pe_category(pe(0, LIMIT, SHORT_Q + 1), SHORT_Q, LIMIT) is Category.LONG_QUEUE
    assert pe_category(pe(0, 0, 0), SHORT_Q, LIMIT) is Category.SHORT_QUEUE


def test_pe_fetch_prefers_short_queue_engines_even_with_more_tokens() -> None:
    engines = [pe(1, 100, SHORT_Q + 5), pe(2, 5_000, 10), pe(3, 20_000, 0)]  # long, short, overloaded
    assert schedule_pe_fetch([req(7, 1_000)], engines, SHORT_Q, LIMIT) == [(7, 2)]


def test_pe_fetch_falls_back_to_long_queue_engines_by_fewest_tokens() -> None:
    engines = [pe(1, 3_000, 5_000), pe(2, 2_000, 9_000), pe(3, LIMIT + 1, 0)]
    assert schedule_pe_fetch([req(7, 500)], engines, SHORT_Q, LIMIT) == [(7, 2)]


def test_pe_fetch_balances_tokens_as_it_assigns_and_stops_when_all_are_overloaded() -> None:
    engines = [pe(1, 0, 0), pe(2, 0, 0)]
    waiting = [req(10, 6_000), req(11, 6_000), req(12, 3_000), req(13, 3_000), req(14, 1)]
    out = schedule_pe_fetch(waiting, engines, SHORT_Q, LIMIT)
    # 10 -> e1 (6K), 11 -> e2 (6K), 12 -> e1 (9K), 13 -> e2 (9K), both still <= beta: 14 -> e1
    assert out == [(10, 1), (11, 2), (12, 1), (13, 2), (14, 1)]
    engines = [pe(1, 9_001, 0), pe(2, 9_000, 0)]  # as the next fetch reports them
    more = schedule_pe_fetch([req(20, 5_000), req(21, 5_000), req(22, 5_000)], engines, SHORT_Q, LIMIT)
    assert more == [(20, 2), (21, 1)]  # then both are overloaded: the fetch ends, 22 keeps waiting


# Inter-engine: DE two-phase (§6.1) ---------------------------------------------------------------


def de(engine_id: int, tokens: int, requests: int, free: int, group: int = 0) -> EngineLoad:
    return EngineLoad(engine_id, group, requests, tokens, 0, free)


def test_de_phase1_sends_each_request_to_the_group_with_fewest_tokens() -> None:
    groups = {0: [de(1, 5_000, 1, 10**6)], 1: [de(2, 1_000, 1, 10**6), de(3, 1_000, 1, 10**6)]}
    out = assign_de_groups([req(1, 3_000), req(2, 3_000), req(3, 100)], groups)
    # totals 5000 vs 2000: 1 -> g1 (5000); tie, lowest id: 2 -> g0 (8000); 3 -> g1 (5100)
    assert [r.req_id for r in out[1]] == [1, 3]
    assert [r.req_id for r in out[0]] == [2]


def need(r: PendingRequest) -> int:
    return r.tokens


def test_de_phase2_prefers_low_token_des_by_fewest_requests() -> None:
    # Z = (9000 + 1000 + 2000 + 1000) / 3 = 4333: DE 1 is high-token; DEs 2, 3 low, 3 has fewer requests.
    engines = [de(1, 9_000, 1, 10**6), de(2, 1_000, 5, 10**6), de(3, 2_000, 2, 10**6)]
    assert schedule_de_group([req(1, 1_000)], engines, need) == [(1, 3)]


def test_de_phase2_uses_the_high_token_de_with_fewest_tokens_when_only_they_have_room() -> None:
    engines = [de(1, 9_000, 1, 5_000), de(2, 8_000, 1, 5_000), de(3, 0, 0, 100)]  # DE 3: no room
    assert schedule_de_group([req(1, 1_000)], engines, need) == [(1, 2)]


def test_de_phase2_stops_at_the_first_request_no_de_can_hold() -> None:
    engines = [de(1, 0, 0, 1_500), de(2, 0, 0, 1_500)]
    out = schedule_de_group([req(1, 1_000), req(2, 1_000), req(3, 1_000), req(4, 10)], engines, need)
    assert out == [(1, 1), (2, 2)]  # request 3 fits nowhere (500 left on each): FIFO stops there


def test_read_path_is_the_side_with_the_shorter_queue() -> None:
    assert choose_read_path(pe_queue_tokens=5_000, de_queue_tokens=100) == "de"
    assert choose_read_path(pe_queue_tokens=100, de_queue_tokens=5_000) == "pe"
    assert choose_read_path(pe_queue_tokens=7, de_queue_tokens=7) == "pe"


# Intra-engine: compute quota with binary search (§6.2) -----------------------------------------


def linear(pairs: Sequence[tuple[int, int]]) -> float:
    return sum(0.01 * new for _, new in pairs)


def quadratic(pairs: Sequence[tuple[int, int]]) -> float:
    return sum(1e-6 * new * (cached + new) for cached, new in pairs)


def test_quota_packs_whole_requests_then_chunks_the_next_exactly_to_the_quota() -> None:
    out = pack_compute_quota([(1, 0, 50), (2, 0, 80), (3, 0, 10)], linear, quota_s=1.005)
    assert out == [(1, 50), (2, 50)]  # 0.5 s + 0.5 s (51 tokens: 1.01 s); request 3 waits (FIFO)


def test_quota_binary_search_finds_the_largest_chunk_that_fits() -> None:
    cands = [(1, 0, 100), (2, 30_000, 5_000)]
    out = pack_compute_quota(cands, quadratic, quota_s=0.5)
    assert out[0] == (1, 100)
    n = out[1][1]
    assert quadratic([(0, 100), (30_000, n)]) <= 0.5 < quadratic([(0, 100), (30_000, n + 1)])


def test_quota_always_gives_the_head_request_a_token() -> None:
    assert pack_compute_quota([(1, 10**9, 10)], quadratic, quota_s=1e-3) == [(1, 1)]


# The policy on a SchedulerView -----------------------------------------------------------------


class Cost:
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 1e-4 * new_tokens

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        return 0.0


def view(
    waiting: tuple[RequestView, ...],
    running: tuple[RequestView, ...],
    free_blocks: int,
    max_batch_tokens: int = 10**9,
    max_running: int = 10**9,
    layerwise_prefill: bool = True,
) -> SchedulerView:
    return SchedulerView(
        now_s=0.0,
        waiting=waiting,
        running=running,
        fetching=(),
        swapped=(),
        free_device_blocks=free_blocks,
        free_host_blocks=None,
        block_tokens=64,
        max_batch_tokens=max_batch_tokens,
        max_running=max_running,
        num_layers=61,
        cost=Cost(),
        layerwise_prefill=layerwise_prefill,
    )


def waiting_request(req_id: int, prompt: int, hit: int) -> RequestView:
    return RequestView(req_id, 0.0, Phase.WAITING, prompt, 0, 0, cached_tokens=(0, hit, 0, 0))


def test_policy_decodes_everything_and_prefills_with_layerwise_loads() -> None:
    decoding = RequestView(5, 0.0, Phase.RUNNING, 100, 100, 3)
    chunked = RequestView(6, 0.0, Phase.RUNNING, 9_000, 5_000, 0)
    w = (waiting_request(7, 1_000, 640), waiting_request(8, 10_000, 6_400))
    d = make_policy("dualpath", compute_quota_s=0.50005).schedule(view(w, (decoding, chunked), 10**6))
    assert d.decode == [5]
    # quota 0.5 s = 5000 new tokens: the chunked request's 4000, request 7's 360, then 640 of 8.
    assert d.prefill == [(6, 4_000), (7, 360), (8, 640)]
    assert [(lo.req_id, lo.tokens, lo.mode) for lo in d.loads] == [
        (7, 640, LoadMode.LAYERWISE),
        (8, 6_400, LoadMode.LAYERWISE),
    ]


def test_basic_loads_synchronously_and_stops_when_the_batch_kv_leaves_hbm() -> None:
    w = (waiting_request(1, 6_400, 6_336), waiting_request(2, 6_400, 6_336))
    # Basic's engine does not stream layers (io: {engine: blocking}): one request is 100 blocks.
    d = make_policy("dualpath_basic").schedule(view(w, (), free_blocks=150, layerwise_prefill=False))
    assert d.prefill == [(1, 64)]
    assert [lo.mode for lo in d.loads] == [LoadMode.SYNC]
    streamed = make_policy("dualpath_basic").schedule(view(w, (), free_blocks=150))
    assert [lo.mode for lo in streamed.loads] == [LoadMode.LAYERWISE] * 2  # +Layerwise: the same policy


def test_policy_parameters_are_checked() -> None:
    basic = make_policy("dualpath_basic")
    assert isinstance(basic, DualPath)
    assert basic.params()["read_paths"] == "pe" and "layerwise" not in basic.params()
    with pytest.raises(ConfigError):
        make_policy("dualpath", read_paths="both")
    with pytest.raises(ConfigError):
        make_policy("dualpath", scheduler="random")
    with pytest.raises(ConfigError):
        make_policy("dualpath", compute_quota_s=0)


def test_policy_keeps_the_engines_token_budget_and_running_slots() -> None:
    """On the reference engine the quota packs inside the engine's own bounds."""
    w = (waiting_request(1, 1_000, 640), waiting_request(2, 1_000, 640), waiting_request(3, 1_000, 640))
    policy = make_policy("dualpath")
    assert policy.schedule(view(w, (), 10**6, max_batch_tokens=500)).prefill == [(1, 360), (2, 140)]
    running = (RequestView(9, 0.0, Phase.RUNNING, 100, 100, 3),)
    assert [rid for rid, _ in policy.schedule(view(w, running, 10**6, max_running=3)).prefill] == [1, 2]
