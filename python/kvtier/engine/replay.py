"""A multi-turn chat workload replayed on the reference engine, once per KV tier (``kvtier demo --engine``).

Each conversation re-sends its whole history every turn (system prompt, earlier questions and the
model's own earlier replies), so from the second turn on most of each prompt was computed before.
The same workload runs under several set-ups, each on a fresh engine:

- ``recompute`` — no store and no device prefix cache: every prompt is prefilled in full;
- ``dram`` — no device prefix cache, a store with a DRAM tier: history comes back from DRAM;
- ``ssd`` — no device prefix cache, a store whose DRAM holds one block and whose SSD tier holds
  everything (written through): history comes back from SSD;
- ``remote`` — the same with a loopback ``redis-server`` (started and stopped here; skipped when
  none is installed) instead of the SSD: history comes back over the Redis protocol;
- ``device`` — the device prefix cache alone (no store), for reference.

Replies are greedy, so every set-up must produce the same conversations token for token (checked;
a mismatch raises). Reported per set-up: mean TTFT of turns 2.., prompt tokens prefilled, tokens
reused per tier.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineError
from kvtier.engine.llm import LLM, llm_store_config
from kvtier.engine.model import Model, load
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tokenizer import Tokenizer
from kvtier.results import Result
from kvtier.store import Store
from kvtier.tiers import Tier

QUESTIONS = (
    ("What is the capital of France?", "What is it famous for?", "Name a river there.", "And a museum?"),
    ("Give me a word that rhymes with cat.", "Another one?", "Use it in a sentence.", "Make it shorter."),
    ("What is 12 times 12?", "And 13 times 13?", "Which is larger?", "By how much?"),
    ("Name a planet.", "Is it larger than Earth?", "How far is it from the Sun?", "Does it have moons?"),
)
SETUPS = ("recompute", "dram", "ssd", "remote", "device")


@dataclass(frozen=True)
class SetupFigures(Result):
    """One set-up's figures as ``kvtier demo --engine`` reports them."""

    ttft_s_per_turn: list[float]
    ttft_s_mean_later_turns: float
    speedup_vs_recompute: float | None
    prefill_tokens: int
    reused_tokens: dict[str, int]
    wall_s: float


@dataclass(frozen=True)
class ReplayResult(Result):
    """What the engine replay reports: every set-up generated the same tokens (else it raises)."""

    conversations: int
    turns: int
    max_tokens: int
    setups: dict[str, SetupFigures]
    identical_outputs: bool = True


@dataclass
class SetupResult:
    name: str
    ttft_s: list[float]  # per turn, mean over conversations
    prefill_tokens: int
    reused_tokens: dict[str, int]
    replies: list[list[list[int]]]  # [conversation][turn] -> tokens
    wall_s: float


def replay(
    model: Model,
    tokenizer: Tokenizer,
    setup: str,
    conversations: int,
    turns: int,
    max_tokens: int,
    ssd_directory: str | None = None,
    remote_url: str | None = None,
) -> SetupResult:
    """Runs the workload once under ``setup`` (see the module doc)."""
    store: Store | None = None
    if setup == "dram":
        store = Store(llm_store_config(dram={"capacity_bytes": "512MiB"}))
    elif setup == "ssd":
        directory = ssd_directory or tempfile.mkdtemp(prefix="kvtier-demo-ssd-")
        store = Store(
            llm_store_config(
                dram={"capacity_bytes": 741_376},  # one object: everything else is read from SSD
                ssd={
                    "directory": directory,
                    "capacity_bytes": "1GiB",
                    "probe_bytes": 0,
                    "write_through": True,
                    "promote_on_hit": False,
                },
            )
        )
    elif setup == "remote":
        if remote_url is None:
            raise EngineError("the remote set-up needs a server URL")
        store = Store(
            llm_store_config(
                dram={"capacity_bytes": 741_376},  # one object: everything else comes from the server
                remote={"urls": (remote_url,), "write_through": True, "promote_on_hit": False},
            )
        )
    elif setup not in SETUPS:
        raise EngineError(f"unknown set-up {setup!r}; expected one of {SETUPS}")
    config = EngineConfig(num_blocks=256, device_prefix_cache=setup == "device")
    llm = LLM(model=model, tokenizer=tokenizer, config=config, store=store)
    params = SamplingParams(max_tokens=max_tokens)
    histories: list[list[dict[str, str]]] = [[] for _ in range(conversations)]
    replies: list[list[list[int]]] = [[] for _ in range(conversations)]
    ttft: list[float] = []
    reused = dict.fromkeys((t.label for t in Tier), 0)
    start = time.perf_counter()
    for turn in range(turns):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": QUESTIONS[c % len(QUESTIONS)][turn % 4]})
        outputs = llm.chat(histories, params)
        ttft.append(sum(o.ttft_s for o in outputs) / len(outputs))
        for c, out in enumerate(outputs):
            histories[c].append({"role": "assistant", "content": out.text})
            replies[c].append(out.token_ids)
            for tier, tokens in out.cached_tokens.items():
                reused[tier] += tokens
    return SetupResult(
        setup, ttft, llm.engine.stats.prefill_tokens, reused, replies, time.perf_counter() - start
    )


def run(
    conversations: int = 2,
    turns: int = 4,
    max_tokens: int = 16,
    setups: tuple[str, ...] = SETUPS,
    ssd_directory: str | None = None,
    show: bool = True,
    model: Model | None = None,
    tokenizer: Tokenizer | None = None,
) -> ReplayResult:
    if model is None or tokenizer is None:
        model, tokenizer = load()
    server = None
    if "remote" in setups:  # a loopback server started and stopped here; skipped when none is installed
        from kvtier.testing.redis import LocalRedis

        try:
            server = LocalRedis(tempfile.mkdtemp(prefix="kvtier-demo-redis-")).start()
        except RuntimeError as exc:
            if show:
                print(f"demo: remote set-up skipped: {exc}")
            setups = tuple(s for s in setups if s != "remote")
    try:
        url = None if server is None else server.url
        results = [
            replay(model, tokenizer, s, conversations, turns, max_tokens, ssd_directory, url) for s in setups
        ]
    finally:
        if server is not None:
            server.stop()
    for r in results[1:]:
        if r.replies != results[0].replies:
            raise EngineError(f"set-up {r.name!r} generated different tokens than {results[0].name!r}")
    base = next((r for r in results if r.name == "recompute"), results[0])
    later = slice(1, None) if turns > 1 else slice(None)
    base_ttft = _mean(base.ttft_s[later])
    figures: dict[str, SetupFigures] = {}
    for r in results:
        mean = _mean(r.ttft_s[later])
        speedup = base_ttft / mean if mean > 0 else None
        figures[r.name] = SetupFigures(r.ttft_s, mean, speedup, r.prefill_tokens, r.reused_tokens, r.wall_s)
    return ReplayResult(conversations, turns, max_tokens, figures)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summary(result: ReplayResult) -> str:
    lines = [
        f"engine replay: {result.conversations} conversations x {result.turns} turns, "
        f"{result.max_tokens} new tokens per reply (SmolLM2-135M, CPU); outputs identical in every set-up",
        f"  {'set-up':10s} {'TTFT turns 2+':>14s} {'vs recompute':>13s} {'prefilled':>10s}  reused tokens",
    ]
    for name, s in result.setups.items():
        reused = ", ".join(f"{k} {v}" for k, v in s.reused_tokens.items() if v) or "none"
        speedup = s.speedup_vs_recompute
        lines.append(
            f"  {name:10s} {s.ttft_s_mean_later_turns:12.3f} s {speedup:12.2f}x {s.prefill_tokens:10d}  {reused}"
        )
    return "\n".join(lines)
