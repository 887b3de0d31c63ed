"""Roofline cost model: shapes of the curves, not absolute times (those are benchmarks' job)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.sim.cost import (
    BatchShape,
    CostModel,
    FixedCostModel,
    PrefillChunk,
    RooflineCostModel,
    link_efficiency,
    make_cost_model,
    transfer_work_s,
)
from kvtier.sim.hardware import hardware_names, load_hardware
from kvtier.sim.models import load_model, model_names

H100 = load_hardware("h100-sxm")
LLAMA8 = load_model("llama-3.1-8b")
ROOFLINE = RooflineCostModel(H100, LLAMA8)


def test_empty_batch_costs_nothing() -> None:
    assert ROOFLINE.step_time_s(BatchShape()) == 0.0


def test_prefill_time_is_a_one_chunk_step() -> None:
    batch = BatchShape((PrefillChunk(1000, 3000),))
    assert ROOFLINE.prefill_time_s(1000, 3000) == ROOFLINE.step_time_s(batch)


def test_prefill_grows_superlinearly_with_long_context() -> None:
    t32k, t64k, t128k = (ROOFLINE.prefill_time_s(n) for n in (32768, 65536, 131072))
    assert t64k > 2.2 * t32k and t128k > 2.4 * t64k
    # A chunk after a long cached context costs more than the same chunk from scratch.
    assert ROOFLINE.prefill_time_s(4096, 60000) > 1.5 * ROOFLINE.prefill_time_s(4096, 0)


def test_one_token_decode_is_memory_bound() -> None:
    cost = ROOFLINE.step_cost(BatchShape(decode_context_tokens=(100,)))
    assert cost.memory_s > 50 * cost.compute_s
    expected = LLAMA8.weight_bytes() / (H100.hbm_bytes_per_s * ROOFLINE.bandwidth_efficiency)
    assert cost.memory_s == pytest.approx(expected, rel=0.01)
    assert ROOFLINE.step_time_s(BatchShape(decode_context_tokens=(100,))) == pytest.approx(
        expected + ROOFLINE.step_overhead_s, rel=0.01
    )


def test_decode_batch_amortises_weights() -> None:
    one = ROOFLINE.step_time_s(BatchShape(decode_context_tokens=(1000,)))
    many = ROOFLINE.step_time_s(BatchShape(decode_context_tokens=(1000,) * 32))
    assert one < many < 2 * one  # 32 tokens for well under twice the time of one


def test_transfer_work_segments_pay_overhead() -> None:
    bw, overhead = H100.host_link.h2d_bytes_per_s, H100.host_link.per_segment_overhead_s
    whole = ROOFLINE.transfer_work_s(2**20, 2**20, bw, overhead)
    paged = ROOFLINE.transfer_work_s(2**20, 4096, bw, overhead)
    assert whole == pytest.approx(2**20 / bw + overhead)
    assert paged - whole == pytest.approx(255 * overhead)
    assert paged > 3 * whole  # 4 KiB pages reach a fraction of the bandwidth
    assert ROOFLINE.transfer_work_s(0, 4096, bw, overhead) == 0.0
    assert transfer_work_s(4097, 4096, bw, 1.0) == pytest.approx(4097 / bw + 2.0)  # partial tail segment


def test_link_efficiency_matches_papers_shape() -> None:
    c2c = load_hardware("gh200").host_link

    # SuperInfer §4.3.1 / Table 1: ~10 GB/s at 64 KB segments (Naive: 9.86-10.75), ~200 GB/s or more
    # at >= 8 MB (Fig. 5); the profile's H2D rate is one direction alone (270 GB/s, Table 1 MS+MK).
    def rate(segment: int) -> float:
        return link_efficiency(segment, c2c.h2d_bytes_per_s, c2c.per_segment_overhead_s) * c2c.h2d_bytes_per_s

    assert rate(64 * 1024) < 11e9
    assert rate(8 * 2**20) > 200e9
    pcie = H100.host_link
    effs = [
        link_efficiency(s, pcie.h2d_bytes_per_s, pcie.per_segment_overhead_s) for s in (4096, 65536, 2**20)
    ]
    assert effs == sorted(effs) and effs[-1] > 0.8


def test_transfer_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        transfer_work_s(10, 0, 1e9, 0.0)
    with pytest.raises(ConfigError):
        transfer_work_s(10, 10, 0.0, 0.0)


def test_tp2_halves_compute_and_adds_allreduce() -> None:
    tp2 = RooflineCostModel(H100, LLAMA8, tp=2)
    batch = BatchShape((PrefillChunk(8192, 0),))
    one, two = ROOFLINE.step_cost(batch), tp2.step_cost(batch)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    assert one.allreduce_s == 0 and two.allreduce_s > 0
    assert tp2.step_time_s(batch) < ROOFLINE.step_time_s(batch)
    assert tp2.kv_bytes_per_token == LLAMA8.kv_bytes_per_token // 2
    hidden_bytes = 8192 * LLAMA8.hidden_size * 2
    expected = 2 * 32 * (tp2.allreduce_latency_s + hidden_bytes / H100.nvlink_bytes_per_s)
    assert two.allreduce_s == pytest.approx(expected)


def test_allreduce_without_nvlink_uses_the_host_link() -> None:
    l40s = load_hardware("l40s")
    batch = BatchShape((PrefillChunk(2048, 0),))
    assert (
        RooflineCostModel(l40s, LLAMA8, tp=2).step_cost(batch).allreduce_s
        > 4 * RooflineCostModel(H100, LLAMA8, tp=2).step_cost(batch).allreduce_s
    )


def test_mla_latent_is_replicated_across_tp() -> None:
    ds = load_model("deepseek-v3")
    assert RooflineCostModel(load_hardware("h200"), ds, tp=8).kv_bytes_per_token == 70272


@pytest.mark.parametrize("tp", [0, 3])
def test_bad_tp_is_rejected(tp: int) -> None:
    with pytest.raises(ConfigError, match="tp"):
        RooflineCostModel(H100, LLAMA8, tp=tp)


def test_bad_efficiency_is_rejected() -> None:
    with pytest.raises(ConfigError, match="mfu_prefill"):
        RooflineCostModel(H100, LLAMA8, mfu_prefill=1.5)


@pytest.mark.parametrize("hw_name", hardware_names())
@pytest.mark.parametrize("model_name", model_names())
def test_every_pair_gives_positive_times(hw_name: str, model_name: str) -> None:
    cost = RooflineCostModel(load_hardware(hw_name), load_model(model_name))
    assert 0 < cost.prefill_time_s(512) < cost.prefill_time_s(1024)
    assert cost.step_time_s(BatchShape(decode_context_tokens=(512,))) > 0
    assert cost.num_layers == load_model(model_name).num_layers


chunks = st.builds(PrefillChunk, st.integers(1, 4096), st.integers(0, 65536))
batches = st.builds(
    BatchShape,
    st.lists(chunks, max_size=4).map(tuple),
    st.lists(st.integers(1, 65536), max_size=64).map(tuple),
)


@given(batches, chunks, st.integers(1, 65536))
def test_adding_work_never_makes_a_step_faster(batch: BatchShape, chunk: PrefillChunk, ctx: int) -> None:
    base = ROOFLINE.step_time_s(batch)
    more_prefill = BatchShape((*batch.prefills, chunk), batch.decode_context_tokens)
    more_decode = BatchShape(batch.prefills, (*batch.decode_context_tokens, ctx))
    assert ROOFLINE.step_time_s(more_prefill) >= base
    assert ROOFLINE.step_time_s(more_decode) >= base


@given(st.integers(1, 8192), st.integers(0, 100000), st.integers(1, 1000))
def test_prefill_monotone_in_tokens_and_context(new: int, ctx: int, extra: int) -> None:
    t = ROOFLINE.prefill_time_s(new, ctx)
    assert ROOFLINE.prefill_time_s(new + extra, ctx) >= t
    assert ROOFLINE.prefill_time_s(new, ctx + extra) >= t


@given(st.integers(0, 2**30), st.integers(1, 2**24))
def test_transfer_work_monotone(nbytes: int, segment: int) -> None:
    bw, overhead = 50e9, 5e-6
    work = transfer_work_s(nbytes, segment, bw, overhead)
    assert work >= nbytes / bw
    assert transfer_work_s(nbytes, segment * 2, bw, overhead) <= work


def test_registry() -> None:
    model: CostModel = make_cost_model("roofline", H100, LLAMA8, tp=2)
    assert model.kv_bytes_per_token == LLAMA8.kv_bytes_per_token // 2
    fixed = make_cost_model("fixed", H100, LLAMA8, step_s=0.01, per_token_s=0.0)
    assert isinstance(fixed, FixedCostModel) and fixed.prefill_time_s(100) == 0.01
    assert fixed.step_time_s(BatchShape()) == 0.0
    with pytest.raises(ConfigError, match=r"unknown cost model 'magic'; known: fitted, fixed, roofline"):
        make_cost_model("magic", H100, LLAMA8)
    with pytest.raises(ConfigError, match="bad parameters"):
        make_cost_model("roofline", H100, LLAMA8, mfu=0.3)


@pytest.mark.parametrize("name", model_names())
@given(st.lists(st.integers(0, 1 << 20), max_size=20))
def test_a_decodes_attention_inline_is_attention_flops_to_the_bit(name: str, contexts: list[int]) -> None:
    # step_cost computes a decode's attention as dense_pair_flops x (ctx + 1.0) pairs (issue 20):
    # it must be the very float attention_flops(1, ctx) gives, or replays would drift.
    model = load_model(name)
    pair = model.dense_pair_flops
    assert (pair is None) == bool(model.index_topk)
    if pair is not None:
        assert [pair * (c + 1.0) for c in contexts] == [model.attention_flops(1, c) for c in contexts]
    ctx = tuple(contexts)
    by_call = sum(model.linear_flops_per_token + model.attention_flops(1, c) for c in ctx)
    cost = RooflineCostModel(H100, model)
    gpu = cost.tp * H100.gpu_bf16_flops_per_s
    assert cost.step_cost(BatchShape((), ctx)).compute_s == by_call / (gpu * cost.mfu_decode)


def _sharded(name: str, tp: int) -> RooflineCostModel | None:
    """The roofline of model ``name`` on ``tp`` H100s; None where the model cannot shard that way
    (the cost model's own check refuses it)."""
    try:
        return RooflineCostModel(H100, load_model(name), tp=tp)
    except ConfigError:
        return None


@pytest.mark.parametrize("name", model_names())
@given(st.lists(st.integers(0, 1 << 20), max_size=300), st.sampled_from([1, 2, 8]))
def test_the_decode_only_step_time_is_step_time_s_to_the_bit(name: str, contexts: list[int], tp: int) -> None:
    # The decode fast-forward plans steps through decode_step_time_s (issue 20): a different float
    # would move every later event.
    cost = _sharded(name, tp)
    if cost is None:
        return
    assert repr(cost.decode_step_time_s(contexts)) == repr(
        cost.step_cost(BatchShape((), tuple(contexts))).total_s
    )


@pytest.mark.parametrize("name", model_names())
@given(
    st.lists(st.integers(0, 1 << 20), max_size=300),
    st.sampled_from([1, 2, 8]),
    st.sampled_from([1.0, 1.37]),
    st.integers(1, 40),
)
@example([0] * 300, 1, 1.0, 3)  # compute bound (dense models): the FLOPs summed per decode
@example([100] * 4, 1, 1.37, 3)  # weights bound: the sum skipped
def test_a_decode_runs_step_times_are_step_time_s_to_the_bit(
    name: str, contexts: list[int], tp: int, slowdown: float, steps: int
) -> None:
    # The fast-forward's run ahead (issue 20): step k decodes every context + k. Small batches are
    # bound by the weights (the FLOPs' sum is skipped), large ones by compute (summed): both exact.
    cost = _sharded(name, tp)
    if cost is None:
        return
    times = cost.step_times.decode_run_s(contexts, slowdown)
    for k in range(steps):
        shape = BatchShape((), tuple(c + k for c in contexts))
        assert repr(next(times)) == repr(cost.step_cost(shape).total_s * slowdown)


@pytest.mark.parametrize("name", model_names())
@given(
    st.lists(st.tuples(st.integers(1, 1 << 14), st.integers(0, 1 << 20)), max_size=8),
    st.lists(st.integers(0, 1 << 20), max_size=64),
    st.sampled_from([1, 2, 8]),
)
def test_step_time_s_is_step_costs_total_to_the_bit(
    name: str, chunks: list[tuple[int, int]], contexts: list[int], tp: int
) -> None:
    # step_time_s reads the roofline's constants once (sim/step_time.py); step_cost computes them
    # every call: the engine's step times must be its floats.
    cost = _sharded(name, tp)
    if cost is None:
        return
    shape = BatchShape(tuple(PrefillChunk(n, c) for n, c in chunks), tuple(contexts))
    assert repr(cost.step_time_s(shape)) == repr(cost.step_cost(shape).total_s)
    for n, c in chunks:  # what policies estimate a prefill with
        one = cost.step_cost(BatchShape((PrefillChunk(n, c),))).total_s
        assert repr(cost.prefill_time_s(n, c)) == repr(one)
