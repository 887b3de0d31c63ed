"""Next-token agreement with codec-round-tripped KV on the real SmolLM2-135M (issue 7, item 3).

The replay path (prefix blocks scattered into a pool from objects, tail prefilled over them) must
reproduce plain greedy decoding exactly when the objects are the exact fp32 KV; then CacheGen's
quantization must keep most greedy tokens, and coarser bins must not do better than finer ones by
a wide margin (the measurement sees the error it is meant to see).
"""

from __future__ import annotations

import pytest

from kvtier import codec
from kvtier.bench.agreement import PROMPTS, Variant, _decode_over_prefix, next_token_agreement
from kvtier.engine import EngineInputError, Model, Tokenizer, greedy_generate


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Model, Tokenizer]) -> tuple[Model, Tokenizer]:
    return smollm2


def test_replay_without_prefix_equals_greedy_generate(engine: tuple[Model, Tokenizer]) -> None:
    model, tokenizer = engine
    prompt = tokenizer.encode_instruct(PROMPTS[1])
    [expected], _ = greedy_generate(model, [prompt], 8)
    assert _decode_over_prefix(model, prompt, None, 0, 16, None, 8) == expected


def test_fp32_objects_agree_exactly_and_quant_keeps_most_tokens(engine: tuple[Model, Tokenizer]) -> None:
    model, tokenizer = engine
    prompts = [tokenizer.encode_instruct(p) for p in PROMPTS[:2]]
    coarse = codec.BinRule(0, 3, 3)
    result = next_token_agreement(
        model,
        prompts,
        steps=12,
        variants=(
            Variant("fp32", "fp32"),
            Variant("quant", "quant"),
            Variant("coarse", "quant", coarse, coarse),
        ),
    )
    # fp16 rounding of a 135M model's KV rarely flips a greedy token; over 24 steps allow none.
    v = result.variants
    assert v["fp32"].agreement == 1.0
    assert v["quant"].agreement >= 0.75, v["quant"]
    assert v["coarse"].agreement < v["quant"].agreement, result
    assert len(v["quant"].per_prompt) == 2
    # As `kvtier bench codec --json` prints it: each variant under its name beside the run's sizes.
    out = result.as_dict()
    assert set(out) == {"prompts", "steps", "block_tokens", "fp32", "quant", "coarse"}
    assert out["quant"] == {
        "agreement": v["quant"].agreement,
        "first_token_agreement": v["quant"].first_token_agreement,
        "per_prompt": v["quant"].per_prompt,
    }


def test_bad_input(engine: tuple[Model, Tokenizer]) -> None:
    model, _ = engine
    with pytest.raises(EngineInputError, match="steps"):
        next_token_agreement(model, [[1] * 40], steps=0)
    with pytest.raises(EngineInputError, match="no full 16-token block"):
        next_token_agreement(model, [[1] * 16], steps=2)
    with pytest.raises(EngineInputError, match="empty"):
        next_token_agreement(model, [], steps=2)
