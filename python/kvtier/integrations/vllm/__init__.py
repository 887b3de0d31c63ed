"""kvtier as a vLLM KV connector (docs/vllm.md).

Launch vLLM with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"dram": {"capacity_bytes": "8GiB"}}}'

The extra config takes `StoreConfig` fields (geometry, model id and rank come from vLLM) or
`{"config_file": "kvtier.yaml"}`. This module imports vLLM; `kvtier.integrations.vllm.config`,
`kv_layout`, `lookup` and `worker` do not, and are tested without it.
"""

from typing import Any

__all__ = ["KvtierConnector", "KvtierConnectorMetadata"]


def __getattr__(name: str) -> Any:
    # Imported on first use (vLLM's `getattr(module, "KvtierConnector")`), so the parts that do not
    # need vLLM import without it.
    if name in __all__:
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
