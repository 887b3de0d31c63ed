"""Development only: writes tests/fixtures/smollm2_kv.npz, real SmolLM2-135M KV blocks for codec work.

Prefills a few fixed prompts (prose and code, raw text without the chat template, so no two prompts
share a prefix block) with kvtier's reference engine and keeps each prompt's first
``--blocks-per-prompt`` full blocks as ``BlockFirst`` objects (:func:`kvtier.engine.capture_kv`).

The ``.npz`` holds:

- ``kv``: float16 ``[block, layer, k|v, token, kv_head, dim]`` — ``kv[i]`` is exactly the bytes of
  one ``BlockFirst`` object of geometry ``Geometry(30, 3, 64, "fp16", block_tokens)``
  (``kv.reshape(n, -1).view(np.uint8)``);
- ``token_ids``: int32 ``[block, token]``; ``prompt_index``, ``block_index``: int32 ``[block]``;
- ``prompt_kinds``: ``"prose"`` or ``"code"`` per prompt; ``block_tokens``: the block size.

Run from the repository root: ``.venv/bin/python scripts/make_kv_fixture.py`` (about 10 s).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtier.engine import capture_kv, load

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--blocks-per-prompt", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent.parent / "tests/fixtures/smollm2_kv.npz"
    )
    args = parser.parse_args()

    model, tokenizer = load()
    keep = args.block_tokens * args.blocks_per_prompt
    prompts = [tokenizer.encode(text)[:keep] for _, text in PROMPTS]
    for (kind, _), ids in zip(PROMPTS, prompts, strict=True):
        if len(ids) < keep:
            raise SystemExit(f"a {kind} prompt has {len(ids)} tokens; need {keep}")
    objects = capture_kv(model, prompts, block_tokens=args.block_tokens, dtype="fp16")
    cfg = model.config
    kv = objects.view(np.float16).reshape(
        -1, cfg.num_layers, 2, args.block_tokens, cfg.num_kv_heads, cfg.head_dim
    )
    n = kv.shape[0]
    np.savez_compressed(
        args.out,
        kv=kv,
        token_ids=np.asarray(prompts, dtype=np.int32).reshape(n, args.block_tokens),
        prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), args.blocks_per_prompt),
        block_index=np.tile(np.arange(args.blocks_per_prompt, dtype=np.int32), len(prompts)),
        prompt_kinds=np.asarray([kind for kind, _ in PROMPTS]),
        block_tokens=np.int32(args.block_tokens),
    )
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {n} blocks of {objects.shape[1]} bytes, {size / 1e6:.2f} MB on disk")
    if size > 8_000_000:
        raise SystemExit("fixture is over 8 MB; use fewer blocks")


if __name__ == "__main__":
    main()
