"""The Llama forward pass in numpy, fp32, over packed varlen batches and any :class:`KvAccess`.

One :meth:`Model.forward` call runs one engine step: the new tokens of several sequences packed into
one flat batch (prefill chunks and decode tokens alike). Per layer::

    x = rms_norm(h) ; q, k, v = x @ W_qkv ; rope(q, k)      # all packed tokens at once
    kv.write(layer, k, v)                                    # new K/V into the cache
    for each sequence: attend(q_seq, *kv.read(layer, seq))   # causal, grouped-query
    h += attn @ W_o ; h += down(silu(x @ W_gate) * (x @ W_up))

Matmuls run over the whole packed batch (one BLAS call per weight per layer); only attention loops
over sequences, since each has its own context. RoPE is half-split (NeoX style) because
:mod:`kvtier.engine.weights` restores HF row order in W_q/W_k; cos/sin are precomputed for every
position up to the model's context length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvtier.engine.errors import EngineInputError
from kvtier.engine.kv import ContiguousKvCache, F32Array, IntArray, KvAccess
from kvtier.engine.tokenizer import Tokenizer
from kvtier.engine.weights import ModelConfig, ModelWeights, load_weights, open_gguf

# Attention scores of one query chunk are at most this many fp32 values (16 MB): a long prefill never
# materialises [queries x context] per head at once, and small chunks skip more causally masked keys.
ATTENTION_SCORES_MAX = 4 * 1024 * 1024


class Model:
    """SmolLM2-style Llama model with fp32 weights. Build one with :func:`load_model`."""

    def __init__(self, config: ModelConfig, weights: ModelWeights) -> None:
        self.config = config
        self.weights = weights
        half = config.head_dim // 2
        inv_freq = config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / config.head_dim)
        angles = np.outer(np.arange(config.max_context_tokens, dtype=np.float64), inv_freq)
        self._cos = np.cos(angles).astype(np.float32)  # [max_context, head_dim / 2]
        self._sin = np.sin(angles).astype(np.float32)
        self._scale = np.float32(1.0 / np.sqrt(config.head_dim))

    def forward(
        self,
        token_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        kv: KvAccess,
        *,
        logits: Literal["last", "all"] = "last",
    ) -> F32Array:
        """Runs one step; returns fp32 logits ``[num_seqs, vocab]`` for each sequence's last new
        token (``logits="last"``) or ``[num_tokens, vocab]`` for every new token (``"all"``).

        ``token_ids`` and ``positions`` are the packed new tokens (sequence 0's, then 1's, ...);
        ``positions`` must be ``context_len - query_len .. context_len - 1`` per sequence of ``kv``.
        """
        if logits not in ("last", "all"):
            raise EngineInputError(f"logits is {logits!r}; expected 'last' or 'all'")
        ids, pos = self._check_inputs(token_ids, positions, kv)
        cfg, weights = self.config, self.weights
        hidden = weights.embedding[ids]
        cos, sin = self._cos[pos][:, None, :], self._sin[pos][:, None, :]
        q_size, kv_size = cfg.hidden_size, cfg.kv_size
        for layer, w in enumerate(weights.layers):
            x = _rms_norm(hidden, w.attn_norm, cfg.rms_norm_eps)
            qkv = x @ w.qkv
            q = _rope(qkv[:, :q_size].reshape(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = _rope(qkv[:, q_size : q_size + kv_size].reshape(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = qkv[:, q_size + kv_size :].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            kv.write(layer, k, v)
            hidden += self._attention(layer, q, pos, kv) @ w.out
            x = _rms_norm(hidden, w.ffn_norm, cfg.rms_norm_eps)
            gate_up = x @ w.gate_up
            gate, up = gate_up[:, : cfg.ffn_size], gate_up[:, cfg.ffn_size :]
            hidden += (_silu(gate) * up) @ w.down
        if logits == "last":
            hidden = hidden[np.cumsum(kv.query_lens) - 1]
        return _rms_norm(hidden, weights.final_norm, cfg.rms_norm_eps) @ weights.lm_head.T

    def _check_inputs(
        self, token_ids: npt.ArrayLike, positions: npt.ArrayLike, kv: KvAccess
    ) -> tuple[IntArray, IntArray]:
        ids = np.asarray(token_ids)
        pos = np.asarray(positions)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise EngineInputError(
                f"token_ids have shape {ids.shape} and dtype {ids.dtype}; expected 1-D ints"
            )
        if ids.size != kv.num_tokens:
            raise EngineInputError(f"{ids.size} token ids but the KV step adds {kv.num_tokens} tokens")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise EngineInputError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        if int(kv.context_lens.max()) > self.config.max_context_tokens:
            raise EngineInputError(
                f"a context of {int(kv.context_lens.max())} tokens exceeds the model's "
                f"{self.config.max_context_tokens}"
            )
        if pos.shape != ids.shape or not np.array_equal(pos, kv.positions()):
            raise EngineInputError(
                "positions must be context_len - query_len .. context_len - 1 for each sequence, packed "
                f"in order (query_lens {kv.query_lens.tolist()}, context_lens {kv.context_lens.tolist()})"
            )
        return ids.astype(np.int64), pos.astype(np.int64)

    def _attention(self, layer: int, q: F32Array, positions: IntArray, kv: KvAccess) -> F32Array:
        """Causal grouped-query attention of each sequence's queries over its context; ``[T, hidden]``."""
        out = np.empty((q.shape[0], self.config.hidden_size), dtype=np.float32)
        start = 0
        for seq in range(kv.num_seqs):
            end = start + int(kv.query_lens[seq])
            k, v = kv.read(layer, seq)
            out[start:end] = self._attend(q[start:end], k, v, positions[start:end])
            start = end
        return out

    def _attend(self, q: F32Array, k: F32Array, v: F32Array, positions: IntArray) -> F32Array:
        """``q`` ``[n, heads, dim]`` over ``k``/``v`` ``[ctx, kv_heads, dim]``; query ``t`` sees keys
        ``0..positions[t]`` (positions ascend). Query heads ``g*h .. g*h + g - 1`` share KV head ``h``."""
        n, ctx = q.shape[0], k.shape[0]
        kv_heads, dim = self.config.num_kv_heads, self.config.head_dim
        group = self.config.num_heads // kv_heads
        # One matrix per KV head whose rows are (token, group member) pairs: GQA as plain batched matmul.
        q_grouped = (
            (q * self._scale)
            .reshape(n, kv_heads, group, dim)
            .transpose(1, 0, 2, 3)
            .reshape(kv_heads, n * group, dim)
        )
        k_h, v_h = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [kv_heads, ctx, dim]
        if n >= 16:  # contiguous copies pay off once several queries reuse them
            k_h, v_h = np.ascontiguousarray(k_h), np.ascontiguousarray(v_h)
        out = np.empty((kv_heads, n * group, dim), dtype=np.float32)
        chunk = max(1, ATTENTION_SCORES_MAX // (kv_heads * group * ctx))
        key_index = np.arange(ctx)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            keys = int(positions[hi - 1]) + 1  # no query of the chunk sees past this key
            rows = slice(lo * group, hi * group)
            scores = q_grouped[:, rows] @ k_h[:, :keys].transpose(0, 2, 1)
            if positions[lo] < keys - 1:  # some query's future is inside the key range: mask it
                future = key_index[None, :keys] > np.repeat(positions[lo:hi], group)[:, None]
                scores += np.where(future, np.float32(-np.inf), np.float32(0.0))
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            out[:, rows] = (scores @ v_h[:, :keys]) / scores.sum(axis=-1, keepdims=True)
        merged: F32Array = out.reshape(kv_heads, n, group, dim).transpose(1, 0, 2, 3).reshape(n, -1)
        return merged


def _rms_norm(x: F32Array, weight: F32Array, eps: float) -> F32Array:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    normed: F32Array = x / np.sqrt(variance + np.float32(eps)) * weight
    return normed


def _silu(x: F32Array) -> F32Array:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x < -88 gives the right limit, -0
        result = (x / (1.0 + np.exp(-x))).astype(np.float32, copy=False)
    return result


def _rope(x: F32Array, cos: F32Array, sin: F32Array) -> F32Array:
    """Half-split rotary embedding: dims ``i`` and ``i + dim/2`` rotate together by ``pos * f_i``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def load_model(path: str | Path | None = None) -> Model:
    """Loads the packaged SmolLM2-135M-Instruct (or the Llama GGUF at ``path``), fp32."""
    reader = open_gguf(path)
    config = ModelConfig.from_gguf(reader)
    return Model(config, load_weights(reader, config))


def load(path: str | Path | None = None) -> tuple[Model, Tokenizer]:
    """The model and its tokenizer from one read of the GGUF file (the packaged one by default)."""
    reader = open_gguf(path)
    config = ModelConfig.from_gguf(reader)
    return Model(config, load_weights(reader, config)), Tokenizer.from_gguf(reader)


def greedy_generate(
    model: Model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    stop_token_ids: tuple[int, ...] = (),
) -> tuple[list[list[int]], list[F32Array]]:
    """Greedy decoding of a batch of prompts on a :class:`ContiguousKvCache`: one packed prefill,
    then batched decode steps. Returns each prompt's new tokens and its logits ``[steps, vocab]``
    (row ``j`` is the distribution token ``j`` was picked from). A sequence stops after a stop token."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise EngineInputError("prompts must be a non-empty list of non-empty token id lists")
    if max_new_tokens < 1:
        raise EngineInputError(f"max_new_tokens is {max_new_tokens}; expected >= 1")
    cache = ContiguousKvCache(model.config)
    seqs = [cache.add_sequence(len(p) + max_new_tokens) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    step_logits: list[list[F32Array]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    step_tokens = [list(p) for p in prompts]
    while active:
        lens = [len(step_tokens[i]) for i in active]
        starts = [cache.num_tokens(seqs[i]) for i in active]
        access = cache.step([seqs[i] for i in active], lens)
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        logits = model.forward(np.concatenate([step_tokens[i] for i in active]), positions, access)
        still_active = []
        for row, i in enumerate(active):
            token = int(np.argmax(logits[row]))
            outputs[i].append(token)
            step_logits[i].append(logits[row])
            step_tokens[i] = [token]
            if len(outputs[i]) < max_new_tokens and token not in stop_token_ids:
                still_active.append(i)
        active = still_active
    return outputs, [np.stack(rows) for rows in step_logits]
