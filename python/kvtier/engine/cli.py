"""``kvtier generate`` and ``kvtier chat``: the reference engine from the command line.

``generate`` runs its prompts as one batch (ChatML-wrapped unless ``--raw``) and prints each reply
(``--json``: one JSON object). ``chat`` reads user turns from stdin, one per line, and answers each
with the whole conversation as context; the engine keeps running between turns, so each turn's
prompt hits the device prefix cache (and the store, with ``--dram-capacity``). It stops at end of
input: a closed or empty stdin ends it at once, never a hang. This module imports nothing heavy
until a command runs (``kvtier --help`` stays fast).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

from kvtier.results import json_text

if TYPE_CHECKING:
    from kvtier.engine import LLM, RequestOutput, SamplingParams


class Generated(TypedDict):
    """One reply of ``kvtier generate --json`` (under ``outputs``)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float
    latency_s: float
    cached_tokens: dict[str, int]  # prompt tokens reused from each tier


def add_commands(sub: Any, positive: Callable[[str], int]) -> None:
    """Adds ``generate`` and ``chat`` to the ``kvtier`` subcommands."""
    gen = sub.add_parser("generate", help="generate replies with the CPU reference engine (SmolLM2-135M)")
    gen.add_argument("prompts", nargs="+", help="prompt text (each argument is one request)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the text as it is")
    _engine_args(gen, positive)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=run_generate)
    chat = sub.add_parser("chat", help="chat on stdin (one user turn per line) with the reference engine")
    chat.add_argument("--system", default=None, help="system prompt (default: the model's)")
    chat.add_argument("--stats", action="store_true", help="print TTFT and cached tokens per turn to stderr")
    _engine_args(chat, positive)
    chat.set_defaults(func=run_chat)


def _engine_args(parser: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    parser.add_argument(
        "--max-tokens", type=positive, default=64, help="tokens generated at most (default 64)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = no cut)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no cut")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument(
        "--policy", default=None, help="scheduling policy (default: fcfs, or lmcache with a store)"
    )
    parser.add_argument(
        "--offload",
        default=None,
        help="what the engine writes to the store: none, write_through (each prompt once prefilled), "
        "write_back (default: the policy's paper's, kvtier.sched.data_plane)",
    )
    parser.add_argument("--num-blocks", type=positive, default=512, help="KV pool blocks (default 512)")
    parser.add_argument("--block-tokens", type=positive, default=16, help="tokens per KV block (default 16)")
    parser.add_argument(
        "--dram-capacity", default=None, help="enable the store with this DRAM tier, e.g. 1GiB"
    )
    parser.add_argument(
        "--ssd-dir", default=None, help="SSD tier directory, written through (needs --dram-capacity)"
    )
    parser.add_argument("--ssd-capacity", default="1GiB", help="SSD tier capacity (default 1GiB)")
    parser.add_argument(
        "--remote-url",
        default=None,
        help="remote tier: a Redis/Valkey server URL, e.g. redis://127.0.0.1:6379 (needs --dram-capacity)",
    )
    parser.add_argument("--threads", type=positive, default=1, help="BLAS threads (default 1)")


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from kvtier.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _llm(args: argparse.Namespace) -> LLM:
    from kvtier.config import parse_size
    from kvtier.engine import LLM, EngineConfig, EngineInputError, llm_store_config

    store = None
    if args.dram_capacity is not None:
        fields: dict[str, Any] = {
            "dram": {"capacity_bytes": parse_size(args.dram_capacity, "--dram-capacity")}
        }
        if args.ssd_dir is not None:
            fields["ssd"] = {
                "directory": args.ssd_dir,
                "capacity_bytes": parse_size(args.ssd_capacity, "--ssd-capacity"),
                "probe_bytes": 0,
                "write_through": True,  # a later process finds the KV even if DRAM never evicted it
            }
        if args.remote_url:
            # Written through, so another process (or node) finds the KV on the server at once.
            fields["remote"] = {"urls": (args.remote_url,), "write_through": True}
        store = llm_store_config(args.block_tokens, **fields)
    elif args.ssd_dir is not None or args.remote_url:
        raise EngineInputError("--ssd-dir and --remote-url need --dram-capacity (those tiers sit below DRAM)")
    config = EngineConfig(num_blocks=args.num_blocks, block_tokens=args.block_tokens, offload=args.offload)
    return LLM(config=config, policy=args.policy, store=store)


def run_generate(args: argparse.Namespace) -> None:
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    sampling = _sampling(args)  # bad sampling flags fail before the model loads
    llm = _llm(args)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        outputs = llm.generate(list(args.prompts), sampling, chat=not args.raw)
    if llm.store is not None:
        llm.store.flush()  # the SSD tier's index is durable for the next process
    if args.json:
        print(json_text({"outputs": [_output_dict(o) for o in outputs]}, sort_keys=True))
        return
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(outputs) > 1:
            print(f"> {prompt}")
        print(out.text)


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
    try:
        _chat(args, stdin, stdout)
    except KeyboardInterrupt:  # Ctrl-C ends the chat like end of input
        print(file=sys.stdout if stdout is None else stdout)


def _chat(args: argparse.Namespace, stdin: TextIO | None, stdout: TextIO | None) -> None:
    from threadpoolctl import threadpool_limits

    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    if stdin is None or stdin.closed:
        return  # no input at all: nothing to answer
    sampling = _sampling(args)
    interactive = stdin.isatty()
    if interactive:
        print("kvtier chat: one message per line; end with Ctrl-D.", file=stdout, flush=True)
    line = _read_turn(stdin, stdout, interactive)
    if not line:
        return  # empty input: the model is never loaded
    llm = _llm(args)
    messages: list[dict[str, str]] = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    with threadpool_limits(limits=args.threads, user_api="blas"):
        while line:
            text = line.strip()
            if not text:
                line = _read_turn(stdin, stdout, interactive)
                continue
            messages.append({"role": "user", "content": text})
            [out] = llm.chat([messages], sampling)
            messages.append({"role": "assistant", "content": out.text})
            print(out.text, file=stdout, flush=True)
            if args.stats:
                cached = ", ".join(f"{k} {v}" for k, v in out.cached_tokens.items() if v)
                print(
                    f"[ttft {out.ttft_s:.3f} s, {len(out.prompt_token_ids)} prompt tokens, "
                    f"cached: {cached or 'none'}]",
                    file=sys.stderr,
                    flush=True,
                )
            line = _read_turn(stdin, stdout, interactive)
    if llm.store is not None:
        llm.store.flush()


def _read_turn(stdin: TextIO, stdout: TextIO, interactive: bool) -> str:
    """The next line of input ("" at end of input)."""
    if interactive:
        stdout.write("> ")
        stdout.flush()
    return stdin.readline()


def _output_dict(out: RequestOutput) -> Generated:
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "prompt_tokens": len(out.prompt_token_ids),
        "finish_reason": out.finish_reason,
        "ttft_s": out.ttft_s,
        "latency_s": out.latency_s,
        "cached_tokens": out.cached_tokens,
    }
