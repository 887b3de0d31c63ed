"""The ``kvtier`` command: ``demo`` and ``bench layout|store``. ``--json`` prints one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.config import parse_size
from kvtier.errors import KvtierError


def _emit(result: dict[str, Any], as_json: bool, summary: Callable[[dict[str, Any]], str]) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(summary(result))


def _demo(args: argparse.Namespace) -> None:
    from kvtier import demo

    result = demo.run(
        conversations=args.conversations,
        turns=args.turns,
        dram_capacity=parse_size(args.dram_capacity, "--dram-capacity"),
        seed=args.seed,
        show=not args.json,
    )
    _emit(result, args.json, demo.summary)


def _bench_layout(args: argparse.Namespace) -> None:
    from kvtier.bench import layout

    result = layout.run(tokens=args.tokens, repeats=args.repeats, threads=args.threads, show=not args.json)
    _emit(result, args.json, layout.summary)


def _bench_store(args: argparse.Namespace) -> None:
    from kvtier.bench import store

    result = store.run(
        total_bytes=parse_size(args.total, "--total"),
        repeats=args.repeats,
        lookup_tokens=args.lookup_tokens,
        threads=args.threads,
        show=not args.json,
    )
    _emit(result, args.json, store.summary)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Hierarchical KV-cache layer for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="multi-turn conversations through the store (embedded defaults)")
    demo.add_argument("--conversations", type=_positive, default=3)
    demo.add_argument("--turns", type=_positive, default=6)
    demo.add_argument("--dram-capacity", default="2GiB", help="DRAM tier capacity (default 2GiB)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser(
        "bench", help="benchmarks; each reports ratios to a limit measured in the same run"
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    layout = bench_sub.add_parser("layout", help="gather/scatter vs memcpy and vs per-segment copies")
    layout.add_argument("--tokens", type=_positive, default=8192)
    layout.add_argument("--repeats", type=_positive, default=5)
    layout.add_argument("--threads", type=int, default=0, help="copy workers (0 = one per core)")
    layout.add_argument("--json", action="store_true")
    layout.set_defaults(func=_bench_layout)
    store = bench_sub.add_parser("store", help="DRAM-tier put/get vs memcpy; 128K-token lookup")
    store.add_argument("--total", default="1GiB", help="bytes per round of 2 MiB objects (default 1GiB)")
    store.add_argument("--repeats", type=_positive, default=5)
    store.add_argument("--lookup-tokens", type=_positive, default=131072)
    store.add_argument("--threads", type=int, default=0, help="copy workers (0 = one per core)")
    store.add_argument("--json", action="store_true")
    store.set_defaults(func=_bench_store)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KvtierError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
