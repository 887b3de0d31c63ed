"""Development only: prefill and decode speed of the reference engine's numpy forward pass.

Measures, on a paged ``LayerFirst`` pool (16-token blocks): load time; prefill tokens/s of one
sequence of 128, 512 and 2048 tokens; decode tokens/s at batch 1 and 8 with a 256-token context.
Each figure is the best of ``--repeats`` runs (the machine may be shared; the best run is the
least disturbed); with ``--threads 1`` it also reports tokens per CPU second, which other processes
on shared cores barely disturb. ``--threads`` caps BLAS threads (threadpoolctl, a dev dependency).

    .venv/bin/python scripts/bench_engine_model.py --threads 2 --json bench-engine-model.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from kvtier.engine import Model, PagedKvPool, load_model, pool_geometry

BLOCK_TOKENS = 16


def best_time(run: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        times.append(clock() - start)
    return min(times)


def prefill_tokens_per_s(model: Model, num_tokens: int, repeats: int, clock: Callable[[], float]) -> float:
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, model.config.vocab_size, num_tokens)
    pool = PagedKvPool(pool_geometry(model.config, BLOCK_TOKENS), -(-num_tokens // BLOCK_TOKENS))
    table = list(range(pool.num_blocks))

    def run() -> None:
        model.forward(tokens, np.arange(num_tokens), pool.step([table], [num_tokens], [num_tokens]))

    return num_tokens / best_time(run, repeats, clock)


def decode_tokens_per_s(
    model: Model, batch: int, context: int, steps: int, repeats: int, clock: Callable[[], float]
) -> float:
    rng = np.random.default_rng(0)
    per_seq = -(-(context + steps) // BLOCK_TOKENS)
    pool = PagedKvPool(pool_geometry(model.config, BLOCK_TOKENS), batch * per_seq)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompt = rng.integers(100, model.config.vocab_size, batch * context)
    positions = np.tile(np.arange(context), batch)
    model.forward(prompt, positions, pool.step(tables, [context] * batch, [context] * batch))

    def run() -> None:
        for step in range(steps):  # rewrites the same slots each repeat: same work every time
            ctx = context + step + 1
            tokens = rng.integers(100, model.config.vocab_size, batch)
            model.forward(tokens, np.full(batch, ctx - 1), pool.step(tables, [ctx] * batch, [1] * batch))

    return batch * steps / best_time(run, repeats, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, default=None, help="BLAS threads (default: BLAS's own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    start = time.perf_counter()
    model = load_model()
    load_s = time.perf_counter() - start
    with threadpool_limits(limits=args.threads, user_api="blas"):
        blas_threads = max(info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas")
        results: dict[str, object] = {
            "cpu_count": os.cpu_count(),
            "blas_threads": blas_threads,
            "load_s": round(load_s, 2),
        }
        # Wall time; with one BLAS thread also process CPU time, which other processes on shared
        # cores barely disturb (with more threads it counts spinning, so it is left out).
        clocks: dict[str, Callable[[], float]] = {"s": time.perf_counter}
        if blas_threads == 1:
            clocks["cpu_s"] = time.process_time
        for unit, clock in clocks.items():
            for n in (128, 512, 2048):
                rate = prefill_tokens_per_s(model, n, args.repeats, clock)
                results[f"prefill_{n}_tokens_per_{unit}"] = round(rate, 1)
            for batch in (1, 8):
                rate = decode_tokens_per_s(
                    model, batch, context=256, steps=16, repeats=args.repeats, clock=clock
                )
                results[f"decode_batch{batch}_ctx256_tokens_per_{unit}"] = round(rate, 1)
    for key, value in results.items():
        print(f"{key:>36}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
