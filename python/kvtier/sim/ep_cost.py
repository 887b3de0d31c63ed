"""Step times of a GPU under DP attention + EP MoE (DualPath §6.2, §7.1): the roofline of
:mod:`kvtier.sim.cost` with the routed experts spread over ``ep`` GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.sim.cost import BANDWIDTH_EFFICIENCY, MFU_DECODE, MFU_PREFILL, STEP_OVERHEAD_S
from kvtier.sim.hardware import HardwareProfile
from kvtier.sim.models import ModelProfile
from kvtier.tiers import Tier


class EpCost:
    """Step times of one GPU under DP attention + EP MoE (the roofline of kvtier.sim.cost with the
    experts spread over ``ep`` GPUs; prefill is compute bound, decode reads its weight share)."""

    def __init__(self, hw: HardwareProfile, model: ModelProfile) -> None:
        self.hw = hw
        self.model = model
        self.kv_bytes_per_token = model.kv_bytes_per_token
        idx = (model.index_head_dim + 4) * model.num_layers if model.index_topk else 0
        self.indexer_bytes_per_token = idx
        self.prefill_flops_per_s = hw.gpu_bf16_flops_per_s * MFU_PREFILL

    def attention_s(self, new_tokens: int, context_tokens: int) -> float:
        return self.model.attention_flops(new_tokens, context_tokens) / self.prefill_flops_per_s

    def linear_s(self, tokens: int) -> float:
        return tokens * self.model.linear_flops_per_token / self.prefill_flops_per_s

    def weight_bytes_per_gpu(self, ep: int) -> float:
        m = self.model
        return (m.total_params - m.routed_expert_params * (1 - 1 / ep)) * m.weight_dtype_bytes

    def decode_step_s(self, contexts: Sequence[int], ep: int) -> float:
        m = self.model
        if not contexts:
            return 0.0
        # attention_flops(1, c) summed in closed form: c + 1 pairs per token, top-k of them attended
        context = sum(contexts)
        attended = (
            sum(min(c + 1, m.index_topk) for c in contexts) if m.index_topk else context + len(contexts)
        )
        per_pair = 2.0 * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
        indexer = 2.0 * m.index_n_heads * m.index_head_dim * (context + len(contexts))
        flops = len(contexts) * m.linear_flops_per_token + m.num_layers * (per_pair * attended + indexer)
        compute_s = flops / (self.hw.gpu_bf16_flops_per_s * MFU_DECODE)
        if m.index_topk:  # sparse attention reads the top-k latents and every indexer key
            read = sum(min(c, m.index_topk) for c in contexts)
            kv = read * (self.kv_bytes_per_token - self.indexer_bytes_per_token)
            kv += context * self.indexer_bytes_per_token
        else:
            kv = context * self.kv_bytes_per_token
        memory_s = (self.weight_bytes_per_gpu(ep) + kv) / (self.hw.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY)
        return max(compute_s, memory_s) + STEP_OVERHEAD_S


class PrefillEstimates:
    """What the policy's compute quota weighs (§6.2): a request's attention time on one GPU."""

    def __init__(self, cost: EpCost) -> None:
        self._cost = cost

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return self._cost.attention_s(new_tokens, context_tokens)

    def load_s(self, tokens: int, tier: Tier, mode: Any) -> float:
        return 0.0
