"""``kvtier bench engine``: the CPU reference engine's speed, and TTFT with the KV cache per tier.

- ``prefill_tokens_per_s``: one 512-token prompt prefilled in one step (fresh engine).
- ``decode_tokens_per_s_batch_1`` / ``_batch_8``: new tokens per second of decode steps over
  64-token prompts (wall time of ``Engine.step``, scheduling included).
- TTFT of a 2K-token shared prefix + 32 new tokens (issue 9): ``ttft_recompute_s`` (no cache: the
  whole prompt is prefilled), ``ttft_dram_hit_s`` (the prefix was saved by an earlier request and
  comes back from the store's DRAM tier into a cold device pool), ``ttft_ssd_hit_s`` (the same from
  the SSD tier: DRAM holds two blocks, promotion off, O_DIRECT reads), ``ttft_remote_hit_s`` (from
  a loopback ``redis-server`` the bench starts and stops: DRAM holds two blocks, written through,
  promotion off; null when no server is installed), and each hit's ratio to recompute
  (``*_ratio``: hit / recompute, lower is better; ``*_speedup``: its inverse). The limit measured
  in the same run is recompute itself. The first token of every hit run must equal the recompute
  run's (checked).

Every request's TTFT is measured from when it is added to a fresh engine to its first token (one
BLAS thread by default: the figure of a shared machine; see docs/engine.md).
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.config import StoreConfig
from kvtier.engine import LLM, EngineConfig, Model, SamplingParams, Tokenizer, llm_store_config
from kvtier.errors import KvtierError
from kvtier.results import Result
from kvtier.store import Store
from kvtier.tiers import Tier

if TYPE_CHECKING:
    from kvtier.sim.validate import Comparison

BLOCK_TOKENS = 16
OBJECT_BYTES = 741_376  # one 16-token fp32 SmolLM2 block in the store (payload + header, whole pages)


@dataclass(frozen=True)
class TierHit(Result):
    """TTFT of a prefix hit from one tier's store (best of the repeats) and what it reused."""

    ttft_hit_s: float
    ttft_hit_ratio: float
    ttft_hit_speedup: float
    load_s: float
    reused_tokens: dict[str, int]


@dataclass(frozen=True)
class Ttft(Result):
    recompute_s: float
    hits: dict[str, TierHit]  # by tier: dram, ssd, remote (when a Redis server is installed)
    remote_skipped: str | None = None


@dataclass(frozen=True)
class EngineBench(Result):
    """What ``kvtier bench engine`` reports: one flat JSON object (per tier ``ttft_{tier}_hit_s``,
    ``_ratio``, ``_speedup``, ``{tier}_load_s``, ``{tier}_reused_tokens``), as it always has."""

    model: str
    blas_threads: int
    repeats: int
    prefix_tokens: int
    new_tokens: int
    prefill_prompt_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s_batch_1: float
    decode_tokens_per_s_batch_8: float
    ttft: Ttft
    sim_validation: Comparison | None = None  # kvtier.engine.validate's report

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            k: getattr(self, k)
            for k in (
                "model", "blas_threads", "repeats", "prefix_tokens", "new_tokens", "prefill_prompt_tokens",
                "prefill_tokens_per_s", "decode_tokens_per_s_batch_1", "decode_tokens_per_s_batch_8",
            )
        }  # fmt: skip
        out["ttft_recompute_s"] = self.ttft.recompute_s
        for tier, hit in self.ttft.hits.items():
            out[f"ttft_{tier}_hit_s"] = hit.ttft_hit_s
            out[f"ttft_{tier}_hit_ratio"] = hit.ttft_hit_ratio
            out[f"ttft_{tier}_hit_speedup"] = hit.ttft_hit_speedup
            out[f"{tier}_load_s"] = hit.load_s
            out[f"{tier}_reused_tokens"] = hit.reused_tokens
        if self.ttft.remote_skipped is not None:
            out |= {
                "ttft_remote_hit_s": None,
                "ttft_remote_hit_ratio": None,
                "remote_skipped": self.ttft.remote_skipped,
            }
        if self.sim_validation is not None:
            out["sim_validation"] = self.sim_validation
            out["sim_ttft_error"] = self.sim_validation["sim_ttft_error"]
            out["sim_tpot_error"] = self.sim_validation["sim_tpot_error"]
            # The engine's own spread over the repeated runs: the noise floor the errors are judged against.
            out["engine_ttft_noise"] = self.sim_validation["engine_ttft_noise"]
            out["engine_tpot_noise"] = self.sim_validation["engine_tpot_noise"]
        return out


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(100, 49_000, size=n)]


def _llm(model: Model, tokenizer: Tokenizer, num_blocks: int, store: Store | None, batch_tokens: int) -> LLM:
    config = EngineConfig(num_blocks=num_blocks, max_batch_tokens=batch_tokens, max_running=16)
    return LLM(model=model, tokenizer=tokenizer, config=config, store=store)


def prefill_tokens_per_s(model: Model, tokenizer: Tokenizer, tokens: int, repeats: int) -> float:
    prompt = _tokens(np.random.default_rng(1), tokens)
    best = float("inf")
    for _ in range(repeats):
        llm = _llm(model, tokenizer, tokens // BLOCK_TOKENS + 4, None, tokens)
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        best = min(best, llm.engine.stats.forward_s)
    return tokens / best


def decode_tokens_per_s(model: Model, tokenizer: Tokenizer, batch: int, steps: int, repeats: int) -> float:
    rng = np.random.default_rng(2)
    prompts = [_tokens(rng, 64) for _ in range(batch)]
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        engine = _llm(model, tokenizer, batch * 8 + 8, None, 64 * batch).engine
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # every prompt in one prefill step
        if engine.stats.decode_tokens or not all(r.output for r in engine.running):
            raise KvtierError("decode bench: the prompts did not prefill in one step")
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        best = min(best, time.perf_counter() - start)
        if engine.stats.decode_tokens != batch * steps:
            raise KvtierError(
                f"decode bench: {engine.stats.decode_tokens} decode tokens, expected {batch * steps}"
            )
    return batch * steps / best


def ttft(
    model: Model,
    tokenizer: Tokenizer,
    prefix_tokens: int,
    new_tokens: int,
    repeats: int,
    directory: str | None,
) -> Ttft:
    rng = np.random.default_rng(3)
    prefix = _tokens(rng, prefix_tokens)
    # Each run gets its own new tokens: a run must not hit blocks an earlier run saved.
    warm = prefix + _tokens(rng, new_tokens)
    probes = [prefix + _tokens(rng, new_tokens) for _ in range(repeats)]
    num_blocks = (prefix_tokens + new_tokens) // BLOCK_TOKENS + 8
    batch_tokens = prefix_tokens + new_tokens
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    recompute = [_llm(model, tokenizer, num_blocks, None, batch_tokens).generate([p], one)[0] for p in probes]
    base = min(o.ttft_s for o in recompute)

    stores = {
        "dram": llm_store_config(dram={"capacity_bytes": (num_blocks + 8) * OBJECT_BYTES}),
        "ssd": llm_store_config(
            dram={"capacity_bytes": 2 * OBJECT_BYTES},
            ssd={
                "directory": directory or tempfile.mkdtemp(prefix="kvtier-bench-engine-"),
                "capacity_bytes": (num_blocks + 8) * OBJECT_BYTES * 2,
                "probe_bytes": 0,
                "write_through": True,
                "promote_on_hit": False,
            },
        ),
    }
    server = _start_redis()
    if server is not None:
        stores["remote"] = llm_store_config(
            dram={"capacity_bytes": 2 * OBJECT_BYTES},
            remote={"urls": (server.url,), "write_through": True, "promote_on_hit": False},
        )
    try:
        hits = _hits(
            model,
            tokenizer,
            stores,
            prefix_tokens,
            warm,
            probes,
            recompute,
            num_blocks,
            batch_tokens,
            base,
        )
    finally:
        if server is not None:
            server.stop()
    skipped = None
    if server is None:
        skipped = "no valkey-server or redis-server installed (apt-get install redis-server)"
    return Ttft(base, hits, skipped)


def _start_redis() -> Any:
    """A loopback ``redis-server`` for the remote figure, or None when none is installed."""
    from kvtier.testing.redis import LocalRedis

    try:
        return LocalRedis(tempfile.mkdtemp(prefix="kvtier-bench-engine-redis-")).start()
    except RuntimeError:
        return None


def _hits(
    model: Model,
    tokenizer: Tokenizer,
    stores: dict[str, StoreConfig],
    prefix_tokens: int,
    warm: list[int],
    probes: list[list[int]],
    recompute: list[Any],
    num_blocks: int,
    batch_tokens: int,
    base: float,
) -> dict[str, TierHit]:
    """TTFT of a prefix hit from each store in ``stores`` (tier name -> config)."""
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    result: dict[str, TierHit] = {}
    for tier, config in stores.items():
        store = Store(config)
        _llm(model, tokenizer, num_blocks, store, batch_tokens).generate([warm], one)  # saves the prefix
        best, load_s, tiers = float("inf"), float("inf"), {}
        for probe, reference in zip(probes, recompute, strict=True):
            llm = _llm(model, tokenizer, num_blocks, store, batch_tokens)  # a cold device pool
            [out] = llm.generate([probe], one)
            if out.token_ids != reference.token_ids:
                raise KvtierError(
                    f"{tier} hit gave token {out.token_ids}, recompute {reference.token_ids}: wrong KV"
                )
            best, load_s = min(best, out.ttft_s), min(load_s, llm.engine.stats.load_s)
            tiers = out.cached_tokens
        expected_tier = Tier.from_store(tier).label
        if (
            sum(tiers.values()) != prefix_tokens // BLOCK_TOKENS * BLOCK_TOKENS
            or tiers[expected_tier] < prefix_tokens // 2
        ):
            raise KvtierError(
                f"{tier} bench: reused tokens per tier {tiers}; expected the prefix from {tier}"
            )
        result[tier] = TierHit(best, best / base, base / best, load_s, tiers)
        del store
        gc.collect()
    return result


def run(
    prefix_tokens: int = 2048,
    new_tokens: int = 32,
    decode_steps: int = 16,
    prefill_tokens: int = 512,
    repeats: int = 2,
    threads: int = 1,
    directory: str | None = None,
    show: bool = True,
    model: Model | None = None,
    tokenizer: Tokenizer | None = None,
    validation: bool = True,
    validation_conversations: int = 4,
    validation_turns: int = 3,
    validation_repeats: int = 3,
    calibration: str = "cpu-smollm2-135m",
) -> EngineBench:
    """The engine's figures; with ``validation``, also the calibrated simulator's error on a held-out
    multi-turn workload (:mod:`kvtier.engine.validate`; ``calibration`` names the fitted cost model)."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    if model is None or tokenizer is None:
        from kvtier.engine import load

        model, tokenizer = load()
    # The validation runs first, in a process that has not yet built stores and large pools (their
    # threads and memory would slow the engine it times, not the simulator's prediction).
    check = None
    if validation:
        from kvtier.engine.validate import validate

        if show:
            print(
                "bench engine: calibrated simulator vs engine on a held-out multi-turn workload", flush=True
            )
        check = validate(
            calibration=calibration,
            conversations=validation_conversations,
            turns=validation_turns,
            threads=threads,
            repeats=validation_repeats,
            model=model,
            tokenizer=tokenizer,
        )
    with threadpool_limits(limits=threads, user_api="blas"):
        return EngineBench(
            model="SmolLM2-135M-Instruct (fp32, numpy)",
            blas_threads=threads,
            repeats=repeats,
            prefix_tokens=prefix_tokens,
            new_tokens=new_tokens,
            prefill_prompt_tokens=prefill_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s(model, tokenizer, prefill_tokens, repeats),
            decode_tokens_per_s_batch_1=decode_tokens_per_s(model, tokenizer, 1, decode_steps, repeats),
            decode_tokens_per_s_batch_8=decode_tokens_per_s(model, tokenizer, 8, decode_steps, repeats),
            ttft=ttft(model, tokenizer, prefix_tokens, new_tokens, repeats, directory),
            sim_validation=check,
        )


def summary(r: EngineBench) -> str:
    lines = [
        f"engine bench: {r.model}, {r.blas_threads} BLAS thread(s), best of {r.repeats}",
        f"  prefill ({r.prefill_prompt_tokens} tokens)   {r.prefill_tokens_per_s:8.0f} tokens/s",
        f"  decode batch 1 / 8     {r.decode_tokens_per_s_batch_1:8.1f} / {r.decode_tokens_per_s_batch_8:.1f} tokens/s",
        f"  TTFT, {r.prefix_tokens}-token cached prefix + {r.new_tokens} new tokens:",
        f"    recompute            {r.ttft.recompute_s:8.3f} s",
    ]
    for tier in ("dram", "ssd", "remote"):
        hit = r.ttft.hits.get(tier)
        if hit is None:
            lines.append(f"    {tier + ' hit':20s} n/a ({r.ttft.remote_skipped or 'not measured'})")
            continue
        lines.append(
            f"    {tier + ' hit':20s} {hit.ttft_hit_s:8.3f} s  "
            f"{hit.ttft_hit_ratio:.3f}x recompute ({hit.ttft_hit_speedup:.1f}x faster; load {hit.load_s:.3f} s)"
        )
    if r.sim_validation is not None:
        v = r.sim_validation
        lines.append(
            f"  calibrated simulator vs engine ({v['requests']} chat turns, calibration {v['calibration']}):"
        )
        lines.append(
            f"    mean TTFT {v['engine_mean_ttft_s']:.3f} s engine, {v['sim_mean_ttft_s']:.3f} s sim: "
            f"error {v['sim_ttft_error']:.3f} (target <= 0.10)"
        )
        lines.append(
            f"    mean TPOT {v['engine_mean_tpot_s']:.4f} s engine, {v['sim_mean_tpot_s']:.4f} s sim: "
            f"error {v['sim_tpot_error']:.3f} (target <= 0.10)"
        )
        lines.append(
            f"    engine's own spread over {v['engine_runs']} runs (noise floor): TTFT "
            f"{v['engine_ttft_noise']:.3f}, TPOT {v['engine_tpot_noise']:.3f}"
        )
        if v.get("calibration_machine_differences"):
            from kvtier.sim.machine import REFIT

            lines.append(
                f"    the calibration was not fitted on this machine: {'; '.join(v['calibration_machine_differences'])}"
            )
            lines.append(f"    (the errors above say little about the model here) refit: {REFIT}")
    return "\n".join(lines)
