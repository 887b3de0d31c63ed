"""The engine's KV hierarchy through ``kvtier.TransferEngine`` jobs (``LLM(transfer_engine=True)``):
a prefix hit from each tier (DRAM, SSD, a real loopback Redis) is token-identical to recompute, and a
corrupt stored block ends the loaded prefix (the engine recomputes from there, never uses it)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from kvtier.engine import LLM, EngineConfig, Model, SamplingParams, Tokenizer, llm_store_config
from kvtier.engine.hierarchy import TransferEngineKvTransfer
from kvtier.store import Store
from kvtier.testing.redis import LocalRedis

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
OBJECT_BYTES = -(-(64 + BLOCK_BYTES) // 4096) * 4096
PARAMS = SamplingParams(max_tokens=6)
PROMPT = "Name three rivers in Europe and say which country each one flows through, in one sentence each."


@pytest.fixture(scope="module")
def parts(smollm2: tuple[Model, Tokenizer]) -> tuple[Model, Tokenizer]:
    return smollm2


@pytest.fixture(scope="module")
def prompt(parts: tuple[Model, Tokenizer]) -> list[int]:
    return parts[1].encode_instruct(PROMPT)


@pytest.fixture(scope="module")
def recompute(parts: tuple[Model, Tokenizer], prompt: list[int]) -> list[int]:
    model, tokenizer = parts
    [out] = LLM(model=model, tokenizer=tokenizer, config=EngineConfig(num_blocks=32)).generate(
        [prompt], PARAMS
    )
    return out.token_ids


def _llm(parts: tuple[Model, Tokenizer], store: Store) -> LLM:
    model, tokenizer = parts
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        config=EngineConfig(num_blocks=32),
        store=store,
        transfer_engine=True,
    )
    assert isinstance(llm.engine.transfer, TransferEngineKvTransfer)
    return llm


def _hit(parts: tuple[Model, Tokenizer], store: Store, prompt: list[int], tier: str) -> LLM:
    llm = _llm(parts, store)  # a fresh device pool: the prefix can only come from the store
    [out] = llm.generate([prompt], PARAMS)
    cap = (len(prompt) - 1) // 16 * 16
    assert out.cached_tokens[tier] == cap, out.cached_tokens
    assert llm.engine.stats.prefill_tokens == len(prompt) - cap
    return llm


def test_dram_hit_through_the_transfer_engine(parts, prompt, recompute) -> None:
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}))
    [first] = _llm(parts, store).generate([prompt], PARAMS)
    assert first.token_ids == recompute
    assert store.stats().put_blocks >= len(prompt) // 16  # saved by a store job
    llm = _hit(parts, store, prompt, "host")
    assert llm.engine.stats.loaded_blocks == (len(prompt) - 1) // 16
    [out] = _llm(parts, store).generate([prompt], PARAMS)
    assert out.token_ids == recompute


def test_ssd_hit_through_the_transfer_engine(parts, prompt, recompute, tmp_path: Path) -> None:
    ssd = {"directory": str(tmp_path), "capacity_bytes": "128MiB", "probe_bytes": 0}
    store = Store(
        llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd={**ssd, "write_through": True})
    )
    _llm(parts, store).generate([prompt], PARAMS)
    store.flush()
    del store
    gc.collect()
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd=ssd))
    llm = _llm(parts, store)
    [out] = llm.generate([prompt], PARAMS)
    assert out.token_ids == recompute
    assert out.cached_tokens["ssd"] == (len(prompt) - 1) // 16 * 16


def test_remote_hit_through_the_transfer_engine(parts, prompt, recompute, tmp_path: Path) -> None:
    server = LocalRedis(tmp_path).start()
    try:
        remote = {"urls": (server.url,), "write_through": True, "promote_on_hit": False}
        _llm(
            parts, Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, remote=remote))
        ).generate([prompt], PARAMS)
        gc.collect()
        # A second store (another process would do the same) with DRAM for one object only.
        store = Store(llm_store_config(dram={"capacity_bytes": OBJECT_BYTES}, remote=remote))
        [out] = _llm(parts, store).generate([prompt], PARAMS)
        assert out.token_ids == recompute
        assert out.cached_tokens["remote"] == (len(prompt) - 1) // 16 * 16
    finally:
        server.stop()


def test_a_corrupt_block_ends_the_transfer_engine_load(parts, prompt, recompute) -> None:
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}))
    _llm(parts, store).generate([prompt], PARAMS)
    keys = store.namespace.block_keys(prompt)
    assert store._corrupt_for_test(keys[2], 1000)
    [out] = _llm(parts, store).generate([prompt], PARAMS)
    assert out.token_ids == recompute
    assert out.cached_tokens["host"] == 2 * 16


@pytest.mark.parametrize("backend", ["zstd", "lz4", "deflate"])
def test_lossless_ssd_and_remote_hits_are_token_identical(
    parts, prompt, recompute, tmp_path: Path, backend
) -> None:
    """Lower tiers storing the engine's fp32 KV through the lossless codec give the same tokens."""
    server = LocalRedis(tmp_path).start()
    (tmp_path / "ssd").mkdir()
    try:
        tiers: dict[str, dict[str, object]] = {
            "ssd": {
                "directory": str(tmp_path / "ssd"),
                "capacity_bytes": "128MiB",
                "probe_bytes": 0,
                "write_through": True,
                "codec": "lossless",
                "codec_backend": backend,
            },
            "remote": {
                "urls": (server.url,),
                "write_through": True,
                "codec": "lossless",
                "codec_backend": backend,
            },
        }
        writer = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, **tiers))
        _llm(parts, writer).generate([prompt], PARAMS)
        writer.flush()
        stats = writer.stats()
        # zstd and deflate shrink fp32 KV (its exponent bytes); lz4's gain is too small on it, so
        # those blocks are stored raw and counted as fallbacks: either way the codec ran.
        encoded = stats.ssd_encoded_blocks, stats.remote_encoded_blocks
        ran = (
            stats.ssd_encoded_blocks + stats.ssd_encode_fallbacks,
            encoded[1] + stats.remote_encode_fallbacks,
        )
        assert min(ran) > 0 and (min(encoded) > 0 or backend == "lz4"), stats
        del writer
        gc.collect()
        # From SSD: a store on the same directory, its DRAM one object, promotion off.
        store = Store(
            llm_store_config(
                dram={"capacity_bytes": OBJECT_BYTES}, ssd={**tiers["ssd"], "promote_on_hit": False}
            )
        )
        [out] = _llm(parts, store).generate([prompt], PARAMS)
        assert out.token_ids == recompute
        assert out.cached_tokens["ssd"] == (len(prompt) - 1) // 16 * 16
        del store
        gc.collect()
        # From the server: a store with no SSD, configured raw (the header says lossless).
        store = Store(
            llm_store_config(
                dram={"capacity_bytes": OBJECT_BYTES}, remote={"urls": (server.url,), "promote_on_hit": False}
            )
        )
        [out] = _llm(parts, store).generate([prompt], PARAMS)
        assert out.token_ids == recompute
        assert out.cached_tokens["remote"] == (len(prompt) - 1) // 16 * 16
    finally:
        server.stop()


def _layerwise_llm(parts: tuple[Model, Tokenizer], store: Store) -> LLM:
    model, tokenizer = parts
    config = EngineConfig(num_blocks=32, layerwise_loads=True)
    return LLM(model=model, tokenizer=tokenizer, config=config, store=store, transfer_engine=True)


def test_layerwise_loads_overlap_the_step_and_are_token_identical(parts, prompt, recompute, tmp_path) -> None:
    """The prefix lands while the step computes (each layer's attention waits for that layer)."""
    waits: list[int] = []
    original = TransferEngineKvTransfer.load_async

    def counting(self, keys, block_ids):  # type: ignore[no-untyped-def]
        pending = original(self, keys, block_ids)
        assert pending is not None
        inner = pending.wait_layer

        def wait_layer(layer: int) -> None:
            waits.append(layer)
            inner(layer)

        pending.wait_layer = wait_layer  # type: ignore[method-assign]
        return pending

    ssd = {"directory": str(tmp_path), "capacity_bytes": "128MiB", "probe_bytes": 0}
    store = Store(
        llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd={**ssd, "write_through": True})
    )
    _llm(parts, store).generate([prompt], PARAMS)
    llm: LLM | None = None
    for source in ("host", "ssd"):
        if source == "ssd":
            store.flush()
            del store, llm  # the engine holds the store too
            gc.collect()
            store = Store(
                llm_store_config(dram={"capacity_bytes": OBJECT_BYTES}, ssd={**ssd, "promote_on_hit": False})
            )
        waits.clear()
        TransferEngineKvTransfer.load_async = counting  # type: ignore[method-assign]
        try:
            llm = _layerwise_llm(parts, store)
            [out] = llm.generate([prompt], PARAMS)
        finally:
            TransferEngineKvTransfer.load_async = original  # type: ignore[method-assign]
        assert out.token_ids == recompute
        assert out.cached_tokens[source] == (len(prompt) - 1) // 16 * 16
        assert waits == list(range(parts[0].config.num_layers)), "one wait per layer, in order"
        assert llm.engine.stats.prefill_tokens == len(prompt) - (len(prompt) - 1) // 16 * 16


def test_a_block_failing_mid_step_voids_the_step_and_recomputes(parts, prompt, recompute) -> None:
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}))
    _llm(parts, store).generate([prompt], PARAMS)
    keys = store.namespace.block_keys(prompt)
    assert store._corrupt_for_test(keys[2], 1000)
    llm = _layerwise_llm(parts, store)
    [out] = llm.generate([prompt], PARAMS)
    assert out.token_ids == recompute  # the step that attended the bad block was thrown away
    assert out.cached_tokens["host"] == 2 * 16
    assert llm.engine.stats.loaded_blocks == 2
    # The voided step's chunk was computed again from block 2 on.
    assert llm.engine.stats.prefill_tokens > len(prompt) - (len(prompt) - 1) // 16 * 16
    llm.engine.check_integrity()
