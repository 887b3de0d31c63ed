"""A tiny Llama with even head counts, so vLLM can split it over two TP ranks.

SmolLM2-135M has 9 query heads and 3 KV heads: TP=2 cannot split it. This model (4 layers, hidden
256, 4 query heads, 2 KV heads of 64, SmolLM2's tokenizer and vocabulary) has random weights, made
once from a fixed seed and written as HF safetensors beside the converted SmolLM2 in the engine
environment (`models/tiny-llama-tp2`), as that one is cached. `initializer_range` 0.2 (not HF's
0.02, whose logits are nearly flat: greedy decoding then repeats one token) makes greedy outputs
depend on the prompt, so wrong KV shows in the tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

VERSION = 1  # bump when the recipe below changes: the cached model is rebuilt
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "initializer_range": 0.2,
}


STAMP = "kvtier-tiny-model.json"


def _cached(out: Path) -> bool:
    stamp = out / STAMP
    return stamp.exists() and json.loads(stamp.read_text()).get("version") == VERSION


def _token_ids(tokenizer_from: Path) -> dict[str, int]:
    base = json.loads((tokenizer_from / "config.json").read_text())
    return {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}


def _publish(model: Any, out: Path, tokenizer_from: Path, stamp: dict[str, Any]) -> Path:
    """Writes ``model`` (float32 safetensors) with SmolLM2's tokenizer files and ``stamp`` to a
    temporary directory beside ``out``, then renames it to ``out`` (readers never see a half)."""
    import torch

    tmp = out.parent / f".{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.float32).save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, tmp / name)
    (tmp / STAMP).write_text(json.dumps({"version": VERSION, **stamp}))
    if _cached(out):  # another test process published it meanwhile (pytest -n): a reader may use it
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)  # an older version's
    try:
        tmp.rename(out)
    except OSError:  # published by another process between the check and the rename
        shutil.rmtree(tmp, ignore_errors=True)
        if not _cached(out):
            raise
    return out


def ensure_tiny_llama(models: Path, tokenizer_from: Path) -> Path:
    """The cached model directory, built on first use (a few seconds)."""
    out = models / "tiny-llama-tp2"
    if _cached(out):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, **_token_ids(tokenizer_from)))
    return _publish(model, out, tokenizer_from, {"config": CONFIG})


def ensure_tiny_mistral(models: Path, tokenizer_from: Path, sliding_window: int = 256) -> Path:
    """The tiny Llama's shape as a Mistral whose every layer has a sliding window of
    ``sliding_window`` tokens (as Mistral-7B-v0.1's), cached beside it."""
    out = models / f"tiny-mistral-sw{sliding_window}"
    if _cached(out):
        return out
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(**CONFIG, **_token_ids(tokenizer_from), sliding_window=sliding_window)
    return _publish(MistralForCausalLM(config), out, tokenizer_from, {"sliding_window": sliding_window})


def make_lora(out: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT's files) on the tiny Llama's K and V projections, so the
    adapter changes the KV itself; another seed, other weights."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    kv_width = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    tensors = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, CONFIG["hidden_size"], generator=gen) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv_width, rank, generator=gen) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["k_proj", "v_proj"]}
    (out / "adapter_config.json").write_text(json.dumps({**config, "bias": "none", "lora_dropout": 0.0}))
    return out
