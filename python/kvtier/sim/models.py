"""Model profiles: the shape numbers of a transformer that decide its cost and its KV size.

A profile is built from HuggingFace ``config.json`` fields (:func:`model_from_hf_config`); the
shipped ones live in ``profiles/models/*.yaml`` with the published config values of each model and
a ``name`` and ``source`` line. Dense (Llama, Mistral, Qwen2.5), MoE (Qwen3-MoE ``num_experts``,
DeepSeek ``n_routed_experts`` with shared experts and leading dense layers) and MLA (DeepSeek
``kv_lora_rank``) shapes are understood; every block is a pre-norm transformer with a gated (SwiGLU)
MLP.

Derived, per model:

- ``total_params`` / ``active_params``: every weight / the weights one token touches (``k`` of the
  routed experts). Embeddings count in both (the published "3.3B activated" of Qwen3-30B-A3B
  includes them). DeepSeek's multi-token-prediction layer is left out (671B, not 685B).
- ``kv_bytes_per_token``: GQA ``2 x layers x kv_heads x head_dim x dtype``; MLA caches one latent
  per layer, ``(kv_lora_rank + qk_rope_head_dim) x layers x dtype``.
- ``linear_flops_per_token``: ``2 x`` the matmul weights a token touches (the input embedding is a
  lookup; the LM head is a matmul, tied or not).
- ``attention_flops``: QK^T and PV over cached context plus the causal new tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sim.hardware import as_number, load_profile_yaml

MODELS_DIR = Path(__file__).parent / "profiles" / "models"

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class ModelProfile:
    """What the simulator needs to know about a model; built by :func:`model_from_hf_config`."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int  # activations and KV cache
    total_params: int
    active_params: int
    kv_bytes_per_token: int
    is_moe: bool
    is_mla: bool
    weight_dtype_bytes: int  # 1 for FP8 checkpoints (DeepSeek-V3), else dtype_bytes
    qk_head_dim: int  # per-head width of Q.K (head_dim; MLA: qk_nope + qk_rope)
    v_head_dim: int  # per-head width of V
    embedding_params: int  # vocab x hidden, counted once even when tied
    tie_word_embeddings: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_moe_layers: int = 0
    num_routed_experts: int = 0
    num_experts_per_tok: int = 0
    routed_expert_params: int = 0  # all routed experts of all MoE layers
    # DeepSeek Sparse Attention (DeepSeek-V3.2 ``index_topk``): each query attends to at most
    # ``index_topk`` keys, picked by a lightning indexer that scores every (query, key) pair with
    # ``index_n_heads`` heads of ``index_head_dim``. 0: dense attention.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {self.name!r}: {name} is {getattr(self, name)}; expected >= 1")
        if not 0 < self.active_params <= self.total_params:
            raise ConfigError(
                f"model {self.name!r}: active_params {self.active_params} not in (0, total {self.total_params}]"
            )
        if self.kv_bytes_per_token < 1 or self.dtype_bytes < 1 or self.weight_dtype_bytes < 1:
            raise ConfigError(f"model {self.name!r}: KV bytes per token and dtype sizes must be >= 1")

    @property
    def linear_flops_per_token(self) -> float:
        """FLOPs of the weight matmuls for one token (everything but attention over context)."""
        lookup_only = 0 if self.tie_word_embeddings else self.embedding_params
        return 2.0 * (self.active_params - lookup_only)

    def attention_flops(self, new_tokens: int, context_tokens: int) -> float:
        """QK^T and PV FLOPs, all layers and heads, for ``new_tokens`` after ``context_tokens`` cached.

        Each new token attends to the context and, causally, to itself and the new tokens before it:
        ``new x context + new x (new + 1) / 2`` query-key pairs, ``2 x (qk + v)`` FLOPs per pair and
        head. For MLA this is the prefill (un-absorbed) form; absorbed decode kernels do more FLOPs
        per pair over the 576-wide latent but are bound by reading it.
        """
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * context_tokens + new_tokens * (new_tokens + 1) / 2
        per_pair = 2.0 * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)
        if self.index_topk:  # sparse: top-k keys per query, plus the indexer over every pair
            attended = min(pairs, new_tokens * float(self.index_topk))
            indexer = 2.0 * self.index_n_heads * self.index_head_dim * pairs
            return self.num_layers * (per_pair * attended + indexer)
        return self.num_layers * per_pair * pairs

    @property
    def dense_pair_flops(self) -> float | None:
        """All layers' FLOPs per (query, key) pair of dense attention: ``attention_flops(n, c)`` is
        this times the pairs, computed in the same order (so the same float); None when sparse."""
        if self.index_topk:
            return None
        return self.num_layers * (2.0 * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim))

    def weight_bytes(self) -> int:
        """Bytes of all weights (every expert), as stored."""
        return self.total_params * self.weight_dtype_bytes

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Expected weight bytes one forward pass over ``num_tokens`` tokens reads from memory.

        Dense: all weights. MoE: everything but the routed experts, plus the expected fraction of
        routed experts at least one token picks, ``1 - (1 - k/E)^tokens`` under uniform routing;
        one token reads exactly its active parameters.
        """
        if num_tokens <= 0:
            return 0.0
        if not self.is_moe:
            return float(self.weight_bytes())
        fraction = 1.0 - (1.0 - self.num_experts_per_tok / self.num_routed_experts) ** num_tokens
        always = self.total_params - self.routed_expert_params
        return (always + fraction * self.routed_expert_params) * self.weight_dtype_bytes

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        """KV bytes per token on one of ``tp`` GPUs: KV heads shard (replicated when tp > heads); MLA's latent is replicated."""
        if self.is_mla or tp <= 1:
            return self.kv_bytes_per_token
        heads_per_gpu = -(-self.num_kv_heads // tp)
        return self.kv_bytes_per_token * heads_per_gpu // self.num_kv_heads


def model_names() -> list[str]:
    """Names of the shipped model profiles (file stems in ``profiles/models``), sorted."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_model(name_or_path: str) -> ModelProfile:
    """The profile named ``name_or_path`` (case-insensitive), or the one in the YAML file at that path."""
    path, data = load_profile_yaml(name_or_path, MODELS_DIR, "model", model_names())
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise ConfigError(f"{path}: field `name` is {name!r}; expected a string")
    config = {k: v for k, v in data.items() if k not in ("name", "source")}
    return model_from_hf_config(name, config, source=str(path))


class _Fields:
    """Typed reads from an HF config mapping; errors name the field and the file."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def integer(self, key: str, default: int | None = None) -> int:
        raw = self.config.get(key)
        if raw is None:
            if default is None:
                raise ConfigError(f"{self.source}: required field `{key}` is missing")
            return default
        value = as_number(raw, f"{self.source}: field `{key}` is {raw!r}")
        if value != int(value):
            raise ConfigError(f"{self.source}: field `{key}` is {raw!r}; expected an integer")
        return int(value)

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.integer(key, default)
        if value < 1:
            raise ConfigError(f"{self.source}: field `{key}` is {value}; expected >= 1")
        return value

    def dtype_bytes(self) -> int:
        raw = self.config.get("torch_dtype", self.config.get("dtype"))
        if raw is None:
            raise ConfigError(f"{self.source}: required field `torch_dtype` is missing")
        if not isinstance(raw, str) or raw not in _DTYPE_BYTES:
            known = ", ".join(_DTYPE_BYTES)
            raise ConfigError(f"{self.source}: field `torch_dtype` is {raw!r}; known: {known}")
        return _DTYPE_BYTES[raw]


def model_from_hf_config(name: str, config: Mapping[str, Any], source: str = "<config>") -> ModelProfile:
    """A :class:`ModelProfile` from HuggingFace ``config.json`` fields (``source`` names it in errors)."""
    f = _Fields(config, source)
    hidden = f.positive("hidden_size")
    layers = f.positive("num_hidden_layers")
    heads = f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", heads)
    is_mla = config.get("kv_lora_rank") is not None
    default_head_dim = hidden // heads
    if is_mla:  # MLA has no head_dim field; report the per-head Q.K width
        default_head_dim = f.positive("qk_nope_head_dim") + f.positive("qk_rope_head_dim")
    head_dim = f.positive("head_dim", default_head_dim)
    intermediate = f.positive("intermediate_size")
    vocab = f.positive("vocab_size")
    dtype_bytes = f.dtype_bytes()
    quant = config.get("quantization_config")
    fp8 = isinstance(quant, Mapping) and quant.get("quant_method") == "fp8"
    tied = bool(config.get("tie_word_embeddings", False))

    if is_mla:
        attn_params, kv_bytes, qk_dim, v_dim = _mla_shape(f, hidden, heads, layers, dtype_bytes)
        if config.get("kv_cache_dtype") == "fp8_ds_mla":
            # FlashMLA's FP8 KV cache (DeepSeek-V3.2): the latent in FP8 with one fp32 scale per
            # 128 values, the RoPE part in bf16: 512 + 16 + 128 = 656 bytes per layer.
            rank, rope = f.positive("kv_lora_rank"), f.positive("qk_rope_head_dim")
            kv_bytes = (rank + 4 * (rank // 128) + 2 * rope) * layers
        if config.get("index_topk") is not None:  # the indexer's FP8 keys and an fp32 scale
            kv_bytes += (f.positive("index_head_dim") + 4) * layers
    else:
        qk_dim = v_dim = head_dim
        kv_bytes = 2 * layers * kv_heads * head_dim * dtype_bytes
        attn_params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        if config.get("attention_bias", False):  # Qwen2.5 QKV bias; set in the YAML
            attn_params += (heads + 2 * kv_heads) * head_dim

    moe = _moe_shape(f, config, hidden, layers)
    dense_mlp = 3 * hidden * intermediate
    num_dense = layers - moe.num_layers
    norms = 2 * hidden * layers + hidden
    embedding = vocab * hidden
    head_and_embed = embedding if tied else 2 * embedding
    shared_and_attn = layers * attn_params + num_dense * dense_mlp + norms + head_and_embed
    total = shared_and_attn + moe.num_layers * (moe.always_params + moe.expert_params * moe.num_experts)
    active = shared_and_attn + moe.num_layers * (moe.always_params + moe.expert_params * moe.top_k)
    return ModelProfile(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        dtype_bytes=dtype_bytes,
        total_params=total,
        active_params=active,
        kv_bytes_per_token=kv_bytes,
        is_moe=moe.num_layers > 0,
        is_mla=is_mla,
        weight_dtype_bytes=1 if fp8 else dtype_bytes,
        qk_head_dim=qk_dim,
        v_head_dim=v_dim,
        embedding_params=embedding,
        tie_word_embeddings=tied,
        kv_lora_rank=f.integer("kv_lora_rank", 0),
        qk_rope_head_dim=f.integer("qk_rope_head_dim", 0),
        num_moe_layers=moe.num_layers,
        num_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        routed_expert_params=moe.num_layers * moe.num_experts * moe.expert_params,
        index_topk=f.integer("index_topk", 0),
        index_n_heads=f.integer("index_n_heads", 0),
        index_head_dim=f.integer("index_head_dim", 0),
    )


def _mla_shape(
    f: _Fields, hidden: int, heads: int, layers: int, dtype_bytes: int
) -> tuple[int, int, int, int]:
    """(attention params per layer, KV bytes per token, qk dim, v dim) of DeepSeek multi-head latent attention."""
    kv_rank = f.positive("kv_lora_rank")
    rope = f.positive("qk_rope_head_dim")
    nope = f.positive("qk_nope_head_dim")
    v_dim = f.positive("v_head_dim")
    q_rank = f.integer("q_lora_rank", 0)
    qk_dim = nope + rope
    q_params = hidden * q_rank + q_rank + q_rank * heads * qk_dim if q_rank else hidden * heads * qk_dim
    kv_params = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    o_params = heads * v_dim * hidden
    kv_bytes = (kv_rank + rope) * layers * dtype_bytes
    return q_params + kv_params + o_params, kv_bytes, qk_dim, v_dim


@dataclass(frozen=True)
class _MoeShape:
    num_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0  # one routed expert
    always_params: int = 0  # router + shared experts, per MoE layer


def _moe_shape(f: _Fields, config: Mapping[str, Any], hidden: int, layers: int) -> _MoeShape:
    """Which layers are MoE and how big their parts are (Qwen-MoE and DeepSeek field names)."""
    num_experts = f.integer("n_routed_experts", f.integer("num_experts", 0))
    if num_experts == 0:
        return _MoeShape()
    top_k = f.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"{f.source}: num_experts_per_tok {top_k} > number of experts {num_experts}")
    expert_inter = f.positive("moe_intermediate_size")
    first_dense = f.integer("first_k_dense_replace", 0)  # DeepSeek: leading dense layers
    freq = f.positive("moe_layer_freq", 1)
    step = f.positive("decoder_sparse_step", 1)  # Qwen-MoE
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list | tuple):
        raise ConfigError(
            f"{f.source}: field `mlp_only_layers` is {mlp_only!r}; expected a list of layer indices"
        )
    moe_layers = sum(
        1
        for i in range(layers)
        if i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in mlp_only
    )
    shared = f.integer("n_shared_experts", 0) * 3 * hidden * expert_inter
    qwen_shared_inter = f.integer("shared_expert_intermediate_size", 0)
    if qwen_shared_inter:
        shared += 3 * hidden * qwen_shared_inter + hidden  # plus its sigmoid gate
    return _MoeShape(
        num_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        expert_params=3 * hidden * expert_inter,
        always_params=hidden * num_experts + shared,
    )
