"""Development only: writes tests/fixtures/smollm2_kv.npz, real SmolLM2-135M KV blocks for codec work.

What it holds and how it is made (the prompts, prefilled on kvtier's reference engine) is
:mod:`kvtier.bench.kv_fixture`, which computes the same file into a user cache where an installed
wheel (which does not ship this 6.9 MB file) runs ``kvtier bench codec`` or ``kvtier bench peers``.

Run from the repository root: ``.venv/bin/python scripts/make_kv_fixture.py`` (about 10 s).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.bench import kv_fixture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--block-tokens", type=int, default=kv_fixture.BLOCK_TOKENS)
    parser.add_argument("--blocks-per-prompt", type=int, default=kv_fixture.BLOCKS_PER_PROMPT)
    parser.add_argument("--out", type=Path, default=kv_fixture.CHECKOUT_PATH)
    args = parser.parse_args()
    n = kv_fixture.write(args.out, args.block_tokens, args.blocks_per_prompt)
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {n} blocks, {size / 1e6:.2f} MB on disk")
    if size > 8_000_000:
        raise SystemExit("fixture is over 8 MB; use fewer blocks")


if __name__ == "__main__":
    main()
