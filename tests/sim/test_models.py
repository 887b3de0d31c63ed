"""Model profiles: published shapes give the published parameter counts and KV sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.sim.models import MODELS_DIR, load_model, model_from_hf_config, model_names

SHIPPED = [
    "deepseek-v3",
    "deepseek-v3.2",
    "ds-27b",
    "llama-3.1-70b",
    "llama-3.1-8b",
    "mistral-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen3-30b-a3b",
    "smollm2-135m",
]

# Published sizes (model cards / safetensors metadata): total, active, relative tolerance.
PUBLISHED = {
    "llama-3.1-8b": (8.03e9, 8.03e9, 0.02),
    "llama-3.1-70b": (70.6e9, 70.6e9, 0.02),
    "mistral-7b": (7.25e9, 7.25e9, 0.02),
    "qwen2.5-14b": (14.7e9, 14.7e9, 0.02),
    "qwen2.5-32b": (32.8e9, 32.8e9, 0.02),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0.03),
    "deepseek-v3": (671e9, 37e9, 0.03),
    "deepseek-v3.2": (671e9, 37e9, 0.03),  # V3 plus the lightning indexer (~0.9B, not counted)
    "smollm2-135m": (135e6, 135e6, 0.02),
    # DualPath's internal "DS 27B" (App. A.2): 27B by its name; no active count is published, so the
    # bound is the profile's own arithmetic (shared parts + 2 shared and 6 of 72 routed experts).
    "ds-27b": (27e9, 4.455e9, 0.03),
}


def test_names_are_the_shipped_files() -> None:
    assert model_names() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_parameter_counts_match_published(name: str) -> None:
    model = load_model(name)
    total, active, tolerance = PUBLISHED[name]
    assert model.total_params == pytest.approx(total, rel=tolerance)
    assert model.active_params == pytest.approx(active, rel=tolerance)
    assert model.weight_bytes() == model.total_params * model.weight_dtype_bytes


def test_kv_bytes_per_token() -> None:
    assert load_model("llama-3.1-8b").kv_bytes_per_token == 131072  # 2 x 32 x 8 x 128 x 2
    llama70 = load_model("llama-3.1-70b")
    assert llama70.num_layers == 80 and llama70.kv_bytes_per_token == 327680
    ds = load_model("deepseek-v3")
    assert ds.is_mla and ds.is_moe
    assert ds.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    # SuperInfer §4.3.1: Qwen2.5-32B, 16-token blocks, 64 KB per layer segment, 4 MB per block.
    assert load_model("qwen2.5-32b").kv_bytes_per_token * 16 == 4 * 2**20


def test_moe_shape() -> None:
    qwen3 = load_model("qwen3-30b-a3b")
    assert qwen3.is_moe and not qwen3.is_mla
    assert qwen3.num_moe_layers == 48 and qwen3.num_routed_experts == 128
    ds = load_model("deepseek-v3")
    assert ds.num_moe_layers == 61 - 3  # first_k_dense_replace
    assert ds.weight_dtype_bytes == 1 and ds.dtype_bytes == 2  # FP8 weights, bf16 KV
    # DualPath App. A.2: 30 layers, 1 leading dense, 72 routed experts, 6 active; FP8 MLA cache
    # (656 bytes) plus the indexer's 64 FP8 key bytes and an fp32 scale, per layer.
    ds27 = load_model("ds-27b")
    assert (ds27.num_moe_layers, ds27.num_routed_experts, ds27.num_experts_per_tok) == (29, 72, 6)
    assert ds27.kv_bytes_per_token == 30 * (656 + 64 + 4)


def test_linear_flops_are_twice_the_matmul_weights() -> None:
    llama = load_model("llama-3.1-8b")  # untied: the input embedding is a lookup
    assert llama.linear_flops_per_token == 2 * (llama.active_params - llama.embedding_params)
    smol = load_model("smollm2-135m")  # tied: the one matrix is the LM head
    assert smol.linear_flops_per_token == 2 * smol.active_params


def test_attention_flops() -> None:
    m = load_model("llama-3.1-8b")
    per_pair = m.num_layers * m.num_attention_heads * 2 * (128 + 128)
    assert m.attention_flops(1, 0) == per_pair
    assert m.attention_flops(1, 99) == 100 * per_pair
    assert m.attention_flops(4, 10) == (40 + 10) * per_pair
    assert m.attention_flops(0, 10) == 0
    # Causal: one chunk of 2n costs the same as n then n more on top of it.
    n = 512
    assert m.attention_flops(2 * n, 0) == pytest.approx(m.attention_flops(n, 0) + m.attention_flops(n, n))


def test_weight_bytes_read_moe() -> None:
    qwen3 = load_model("qwen3-30b-a3b")
    assert qwen3.weight_bytes_read(1) == pytest.approx(qwen3.active_params * 2)
    reads = [qwen3.weight_bytes_read(t) for t in (1, 4, 16, 64, 256, 4096)]
    assert reads == sorted(reads)
    assert reads[-1] == pytest.approx(qwen3.weight_bytes(), rel=1e-3)
    dense = load_model("mistral-7b")
    assert dense.weight_bytes_read(1) == dense.weight_bytes_read(100) == dense.weight_bytes()


def test_kv_bytes_per_gpu() -> None:
    llama = load_model("llama-3.1-70b")  # 8 KV heads
    assert llama.kv_bytes_per_token_per_gpu(2) == llama.kv_bytes_per_token // 2
    assert llama.kv_bytes_per_token_per_gpu(16) == llama.kv_bytes_per_token // 8  # replicated heads
    ds = load_model("deepseek-v3")
    assert ds.kv_bytes_per_token_per_gpu(8) == ds.kv_bytes_per_token  # latent replicated


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown model profile 'gpt-5'.*deepseek-v3.*smollm2-135m"):
        load_model("gpt-5")


def _llama_yaml() -> dict[str, Any]:
    data = yaml.safe_load((MODELS_DIR / "llama-3.1-8b.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_missing_field_names_field_and_file(tmp_path: Path) -> None:
    data = _llama_yaml()
    del data["num_hidden_layers"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"broken\.yaml.*`num_hidden_layers` is missing"):
        load_model(str(path))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("torch_dtype", "int3", "torch_dtype"),
        ("hidden_size", 0, "expected >= 1"),
        ("vocab_size", "many", "expected a number"),
        ("num_key_value_heads", 2.5, "expected an integer"),
    ],
)
def test_bad_fields_are_named(key: str, value: object, message: str) -> None:
    config = {k: v for k, v in _llama_yaml().items() if k not in ("name", "source")}
    config[key] = value
    with pytest.raises(ConfigError, match=message):
        model_from_hf_config("bad", config, source="bad.json")


def test_hf_defaults() -> None:
    """HF defaults: no num_key_value_heads means MHA; no head_dim means hidden / heads."""
    config = {
        "hidden_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
        "vocab_size": 1000,
        "torch_dtype": "float16",
    }
    m = model_from_hf_config("tiny", config)
    assert m.num_kv_heads == 16 and m.head_dim == 64
    assert m.kv_bytes_per_token == 2 * 2 * 16 * 64 * 2
    assert m.total_params == 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024) + 1024 + 2 * 1000 * 1024


def test_top_k_above_expert_count_is_rejected() -> None:
    config = {k: v for k, v in yaml.safe_load((MODELS_DIR / "qwen3-30b-a3b.yaml").read_text()).items()}
    config["num_experts_per_tok"] = 500
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        model_from_hf_config("bad-moe", config)
