"""What keeps the vLLM connector's KV apart (docs/vllm.md, "Keys"): two configurations or requests
whose KV differs for the same tokens must never share a kvtier key. No vLLM here: the keying
functions the connector calls (tests/vllm runs them inside vLLM)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import (
    ConnectorSettings,
    check_parallelism,
    geometry_for,
    model_variant,
    request_extra,
)
from kvtier.integrations.vllm.kv_layout import layout_tag

SETTINGS = ConnectorSettings.from_extra_config({"dram": {"capacity_bytes": "8MiB", "prefault": False}})


def namespace(variant: str = "", layout: str = "cpu:torch.float32:3x128x128:1seg", layers: int = 30) -> bytes:
    geometry = geometry_for(layers, 3, 64, "torch.bfloat16", 128)
    return SETTINGS.store_config(geometry, "smollm", None, variant, 1, layout, 0).namespace.hash


def test_pipeline_and_context_parallelism_are_refused_at_start() -> None:
    # Two pipeline stages of a 30-layer model each hold 15 layers under TP rank 0: the connector
    # gave both the same geometry, model id and rank, so the same namespace, and stage 1 would
    # load stage 0's layers from a tier both reach.
    for sizes, name in (
        ((2, 1, 1), "pipeline_parallel_size=2"),
        ((1, 2, 1), "decode_context_parallel_size=2"),
        ((1, 1, 4), "prefill_context_parallel_size=4"),
    ):
        with pytest.raises(ConfigError, match=name):
            check_parallelism(*sizes)
    check_parallelism(1, 1, 1)


def test_a_salt_cannot_spell_another_salt_and_adapter() -> None:
    # Every part is length-prefixed: a tenant's salt holding the separator of the old encoding
    # ("\x00lora=") no longer gives the bytes of another salt with an adapter.
    assert request_extra("a\x00lora=b", None) != request_extra("a", "b\x00lora=")
    assert request_extra("ab", "c") != request_extra("a", "bc")
    assert request_extra("x", None) != request_extra(None, "x")
    assert request_extra("\ud800", None)  # any str a caller can pass: never an error in the scheduler


def test_an_adapter_name_given_to_other_weights_is_another_key() -> None:
    # A persistent tier outlives the server: after a restart, "sql" may name another adapter.
    assert request_extra(None, "sql", "/adapters/sql-v1") != request_extra(None, "sql", "/adapters/sql-v2")
    assert request_extra("t", "sql", "/a") != request_extra("t", "sql", "/b")
    assert request_extra(None, None, "/a") == b""  # no adapter, no salt: the plain keys


def test_kv_cast_from_another_compute_dtype_is_another_variant() -> None:
    # float32 activations rounded into a bfloat16 cache are not a bfloat16 model's KV, though
    # the geometry (bf16) and the layout (torch.bfloat16 tensors) are the same.
    computed_in_fp32 = model_variant(None, None, None, "float32")
    assert computed_in_fp32 and computed_in_fp32 != model_variant(None, None, None)
    assert namespace(computed_in_fp32) != namespace()
    assert model_variant("awq", None, None, "float32") != model_variant("awq", None, None)
    assert model_variant(None, None, None, None) == ""  # KV in the model's own dtype: plain id


def test_a_layout_tag_drops_only_the_block_axis() -> None:
    # With 128 blocks, dropping every dimension equal to the block count left "3" for both of
    # these byte orders (head-major and token-major blocks of 3 heads x 128 tokens).
    head_major = layout_tag("cpu", "torch.bfloat16", (128, 3, 128, 128), 1)
    token_major = layout_tag("cpu", "torch.bfloat16", (128, 128, 3, 128), 1)
    assert head_major != token_major
    assert head_major == "cpu:torch.bfloat16:3x128x128:1seg"
    # Any other block count gives the tag it always gave (stored blocks keep their namespace).
    assert layout_tag("cpu", "torch.bfloat16", (1000, 3, 128, 128), 1) == head_major
    assert layout_tag("cuda", "torch.float16", (2, 64, 16, 8, 64), 2) == "cuda:torch.float16:2x16x8x64:2seg"
