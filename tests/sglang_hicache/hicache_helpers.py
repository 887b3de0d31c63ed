"""SGLang's own host KV pools and storage configs, built on CPU for the backend tests (and for the
second-process scripts, which import this file by path)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
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
) -> Any:
    """SGLang's MHA or MLA host pool over small CPU device buffers: 33 pages of 4 tokens (or
    pages of ``page`` tokens; ``ratio`` times the device's 64 tokens)."""
    device = torch.device("cpu")
    # A fixed budget: SGLang otherwise sizes host pools from free RAM minus 10 GiB.
    with host_memory_budget_scope(1 << 30):
        if kind == "mha":
            k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
            v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
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
                head_num=HEADS,
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
                end_layer=LAYERS,
            )
        rows = tuple(torch.zeros(DEVICE_TOKENS, 1, LATENT, dtype=dtype) for _ in range(LAYERS))
        mla = MLABufferInfo(
            buffers=rows,
            data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
            layer_indices=tuple(range(LAYERS)),
            device_layer_num=LAYERS,
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
            end_layer=LAYERS,
            target_layer_num=LAYERS,
        )


def storage_config(
    extra: dict[str, Any],
    *,
    model: str | None = "org/test-model",
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    page_first: bool = True,
    metrics: bool = False,
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
        extra_config={**BACKEND, **extra},
    )


def backend(pool: Any, extra: dict[str, Any], **config: Any) -> Any:
    """The backend as SGLang makes it: the dynamic factory, then register_mem_pool_host."""
    is_mla = isinstance(pool, MLATokenToKVPoolHost)
    cfg = storage_config(extra, is_mla=is_mla, page_first=pool.layout != "layer_first", **config)
    made = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    made.register_mem_pool_host(pool)
    return made


def fill(pool: Any, pages: int, seed: int) -> torch.Tensor:
    """Allocates ``pages`` pages of the pool, fills them with random bytes; returns their slots."""
    slots = pool.alloc(pages * pool.page_size)
    assert slots is not None
    gen = torch.Generator().manual_seed(seed)
    for i in range(pages):
        page = pool.get_data_page(int(slots[i * pool.page_size]), flat=True)
        data = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=gen)
        pool.set_from_flat_data_page(int(slots[i * pool.page_size]), data.view(pool.dtype))
    return slots


def page_bytes(pool: Any, slots: torch.Tensor, i: int) -> bytes:
    """Page ``i`` of ``slots`` as SGLang's flat page bytes."""
    page = pool.get_data_page(int(slots[i * pool.page_size]), flat=True)
    return bytes(page.contiguous().view(torch.uint8).numpy())


def page_keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(n)]
