"""SGLang's own host KV pools and storage configs, built on CPU for the backend tests (and for the
second-process scripts, which import this file by path)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 2, 2, 8, 4, 64
LATENT = 24  # MLA: kv_lora_rank 16 + rope 8
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]
BACKEND = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integrations.sglang",
    "class_name": "KvtierHiCacheStorage",
    "interface_v1": 1,
}


def host_pool(
    kind: str = "mha",
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
    page: int = PAGE,
    ratio: float = 2.0,
    layers: int = LAYERS,
    heads: int = HEADS,
) -> Any:
    """SGLang's MHA or MLA host pool over small CPU device buffers: 33 pages of 4 tokens (or
    pages of ``page`` tokens; ``ratio`` times the device's 64 tokens) of ``layers`` layers (a
    hybrid model's SWA pool is such a pool, over its SWA layers)."""
    device = torch.device("cpu")
    # A fixed budget: SGLang otherwise sizes host pools from free RAM minus 10 GiB.
    with host_memory_budget_scope(1 << 30):
        if kind == "mha":
            k = tuple(torch.zeros(DEVICE_TOKENS, heads, HEAD_DIM, dtype=dtype) for _ in range(layers))
            v = tuple(torch.zeros(DEVICE_TOKENS, heads, HEAD_DIM, dtype=dtype) for _ in range(layers))
            buffers = KVBuffers(
                k=k,
                v=v,
                k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                layout=KVBufferLayout.NHD,
            )
            info = MHABufferInfo(
                buffers=buffers,
                page_size=page,
                head_num=heads,
                head_dim=HEAD_DIM,
                v_head_dim=HEAD_DIM,
                dtype=dtype,
                device=device,
            )
            return MHATokenToKVPoolHost(
                info,
                ratio,
                0,
                page,
                layout,
                pin_memory=False,
                device="cpu",
                device_capacity_tokens=DEVICE_TOKENS,
                start_layer=0,
                end_layer=layers,
            )
        rows = tuple(torch.zeros(DEVICE_TOKENS, 1, LATENT, dtype=dtype) for _ in range(layers))
        mla = MLABufferInfo(
            buffers=rows,
            data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
            layer_indices=tuple(range(layers)),
            device_layer_num=layers,
            page_size=page,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            kv_cache_dim=LATENT,
            dtype=dtype,
            device=device,
        )
        return MLATokenToKVPoolHost(
            mla,
            ratio,
            0,
            page,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=DEVICE_TOKENS,
            start_layer=0,
            end_layer=layers,
            target_layer_num=layers,
        )


def mamba_pool(
    layout: str = "page_first", slots: int = 8, side_state: bool = True, conv_only: bool = False
) -> Any:
    """SGLang's Mamba state host pool on CPU: 2 layers of an fp32 temporal (SSM) state, a bf16
    conv state, and (``side_state``) an int32 per-slot side state; 17 slots (twice ``slots``,
    plus SGLang's one). ``conv_only``: a model without SSM state (an empty temporal buffer)."""
    temporal = torch.zeros(2, slots, 0 if conv_only else 2, 4, 8, dtype=torch.float32)
    info = MambaStateBufferInfo(
        temporal=temporal,
        conv=(torch.zeros(2, slots, 6, 3, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(slots, 6, dtype=torch.int32),) if side_state else (),
    )
    with host_memory_budget_scope(1 << 30):
        return MambaPoolHost(
            info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout
        )


def hybrid_pools(
    kind: str = "mha", layout: str = "page_first", dtype: torch.dtype = torch.bfloat16
) -> dict[PoolName, Any]:
    """A hybrid model's host pools: the KV pool (the anchor), an SWA KV pool of 1 layer and a
    Mamba state pool."""
    return {
        PoolName.KV: host_pool(kind, layout, dtype, ratio=8.0),
        PoolName.SWA: host_pool(kind, layout, dtype, ratio=8.0, layers=1),
        PoolName.MAMBA: mamba_pool(),
    }


def storage_config(
    extra: dict[str, Any],
    *,
    model: str | None = "org/test-model",
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    page_first: bool = True,
    metrics: bool = False,
    tp_lcm_size: int | None = None,
    should_split_heads: bool = False,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model,
        tp_lcm_size=tp_lcm_size,
        should_split_heads=should_split_heads,
        extra_config={**BACKEND, **extra},
    )


def backend(
    pool: Any, extra: dict[str, Any], extras: dict[PoolName, Any] | None = None, **config: Any
) -> Any:
    """The backend as SGLang attaches it: the dynamic factory, register_mem_pool_host (the KV
    pool), for a hybrid model register_mem_host_pool_v2 of every pool of the group (``extras``
    are the other pools), then on_host_pools_registered (`cache_controller.py` 613-619,
    `hybrid_cache_controller.py` 342-357)."""
    is_mla = isinstance(pool, MLATokenToKVPoolHost)
    if config.get("tp_lcm_size"):  # as SGLang's cache controller decides it (cache_controller.py 777-788)
        lcm, tp = config["tp_lcm_size"], config.get("tp_size", 1)
        config["should_split_heads"] = not is_mla and pool.layout == "page_head" and lcm > tp
    cfg = storage_config(extra, is_mla=is_mla, page_first=pool.layout != "layer_first", **config)
    made = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    made.register_mem_pool_host(pool)
    if extras is not None:
        for name, p in {PoolName.KV: pool, **extras}.items():
            made.register_mem_host_pool_v2(p, name)
    made.on_host_pools_registered()
    return made


def hybrid_backend(pools: dict[PoolName, Any], extra: dict[str, Any], **config: Any) -> Any:
    """``backend`` of a hybrid model's pools (``pools`` holds the KV pool)."""
    kv = pools[PoolName.KV]
    return backend(kv, extra, {name: p for name, p in pools.items() if name != PoolName.KV}, **config)


def fill(pool: Any, pages: int, seed: int) -> torch.Tensor:
    """Allocates ``pages`` pages of the pool, fills them with random bytes; returns their slots."""
    slots = pool.alloc(pages * pool.page_size)
    assert slots is not None
    gen = torch.Generator().manual_seed(seed)
    for i in range(pages):
        page = pool.get_data_page(int(slots[i * pool.page_size]), flat=True)
        data = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=gen)
        pool.set_from_flat_data_page(int(slots[i * pool.page_size]), data.view(page.dtype))
    return slots


def page_bytes(pool: Any, slots: torch.Tensor, i: int) -> bytes:
    """Page ``i`` of ``slots`` as SGLang's flat page bytes."""
    page = pool.get_data_page(int(slots[i * pool.page_size]), flat=True)
    return bytes(page.contiguous().view(torch.uint8).numpy())


def page_keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(n)]
