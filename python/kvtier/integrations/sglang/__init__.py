"""kvtier as an SGLang HiCache storage backend (docs/sglang.md).

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "dram": {"capacity_bytes": "8GiB"}}'

The extra config takes `StoreConfig` fields (geometry and rank come from SGLang) or
`{"config_file": "kvtier.yaml"}`. A hybrid model's other host pools (SWA KV, Mamba state) are
stored by the v2 calls, each pool in a store of its own (`pools`, `hybrid`). `KvtierHiCacheStorage` imports SGLang and torch;
`kvtier.integrations.sglang.config` imports neither, `host_pool` only torch.
"""

from typing import Any

__all__ = ["KvtierHiCacheStorage", "KvtierStorageMetrics"]


def __getattr__(name: str) -> Any:
    # Imported on first use (SGLang's factory does `getattr(module, "KvtierHiCacheStorage")`), so
    # the parts that do not need SGLang import without it.
    if name in __all__:
        from kvtier.integrations.sglang import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
