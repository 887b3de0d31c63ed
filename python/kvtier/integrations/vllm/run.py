"""Runs real vLLM with or without kvtier's connector; prints one `RESULT <json>` line.

Used by the vLLM test suite (tests/vllm) and `kvtier bench vllm`, each run in its own process as a
user's vLLM is: its DRAM tier dies with it, so a hit in a later run came from the SSD pool or
Redis. Usage: `python -m kvtier.integrations.vllm.run '<json spec>'` (or `@<file>` holding it: a
long prompt list passes the kernel's 128 KiB limit on one argument); the spec holds `model`,
`prompts` (a list of rounds, each one `generate` call: a list of prompts, a prompt being text, a
list of token ids, or a mapping vLLM takes as a prompt such as `{"prompt": ..., "cache_salt":
...}`, which may add `"lora": {"name": ..., "path": ...}` for a LoRA adapter; or "+turn" to
extend the previous round's first prompt with its output and a new question; or "+reset" to
reset vLLM's prefix cache and the connector's (`reset_prefix_cache(reset_connector=True)`: the
round is `{"reset": <what it returned>}`); or `{"prompts":
[...], "max_tokens": n}` for a round of its own length), `max_tokens`, `multiprocess`,
`prefix_caching`, `engine` (more `LLM` arguments, such as `tensor_parallel_size`), `connector`
(the `kv_connector_extra_config`, or null for plain vLLM) with `kv_role`, and `metrics` (true:
vLLM keeps its stats, and the result's `vllm_metrics` holds every `vllm:kvtier_*` counter in
vLLM's Prometheus registry, summed over labels). Each round reports its wall time (with
`max_tokens=1` that is the request's TTFT) and, with the connector in this process, `load_s`:
the seconds its loads took in that round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.config import transfer_config
from kvtier.results import json_text

if TYPE_CHECKING:
    from kvtier.integrations.vllm.worker import WorkerSide


def main() -> None:
    arg = sys.argv[1]
    spec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    if not spec.get("multiprocess", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs: dict[str, object] = {}
    if not spec.get("multiprocess", False):
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("metrics", False):
        kwargs["disable_log_stats"] = False
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = transfer_config(spec["connector"], spec.get("kv_role", "kv_both"))
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 4096),
        max_num_batched_tokens=spec.get("max_model_len", 4096),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        enable_prefix_caching=spec.get("prefix_caching", False),
        **kwargs,
        **spec.get("engine", {}),
    )
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8))
    rounds = []
    local = spec.get("connector") is not None and not spec.get("multiprocess", False)
    previous: list[dict[str, object]] = []
    lora_ids: dict[tuple[str, str], int] = {}
    for prompts in spec["prompts"]:
        round_params = params
        if isinstance(prompts, dict):  # {"prompts": [...], "max_tokens": n}: this round's own
            round_params = SamplingParams(temperature=0, max_tokens=prompts["max_tokens"])
            prompts = prompts["prompts"]
        if prompts == "+reset":  # vLLM's own and the connector's caches (as after a weight update)
            rounds.append({"reset": llm.reset_prefix_cache(reset_connector=True)})
            continue
        if prompts == "+turn":
            first = previous[0]
            prompts = [f"{first['prompt']}{first['text']}\nUser: and what happened next?\nAssistant:"]
        inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        loras = [_lora(p.pop("lora", None), lora_ids) if isinstance(p, dict) else None for p in inputs]
        load0 = local_load_s()
        t0 = time.perf_counter()
        outs = llm.generate(inputs, round_params, use_tqdm=False, lora_request=loras if any(loras) else None)
        wall = time.perf_counter() - t0
        load_s = local_load_s() - load0
        previous = [
            {
                "prompt": p if isinstance(p, str) else "",
                "text": o.outputs[0].text,
                "token_ids": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens,
                "prompt_tokens": len(o.prompt_token_ids),
            }
            for p, o in zip(prompts, outs, strict=True)
        ]
        rounds.append({"wall_s": wall, "outputs": previous, **({"load_s": load_s} if local else {})})
    result: dict[str, object] = {"rounds": rounds}
    if spec.get("metrics", False):
        result["vllm_metrics"] = kvtier_metrics()
    if local:
        # Single process: the worker is here; finish its saves and make the SSD tier durable.
        result |= close_local_workers()
    print("RESULT " + json_text(result), flush=True)


def _lora(lora: Any, ids: dict[tuple[str, str], int]) -> object:
    """vLLM's LoRARequest for ``{"name": ..., "path": ...}`` (an id per name and path), or None."""
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    key = (lora["name"], lora["path"])
    return LoRARequest(lora["name"], ids.setdefault(key, len(ids) + 1), lora["path"])


def kvtier_metrics() -> dict[str, float]:
    """The connector's counters in vLLM's Prometheus registry (what its `/metrics` serves), as
    `{"vllm:kvtier_<name>_total": value summed over labels}`. Read from the registry itself:
    `LLM.get_metrics()` rounds counters down to integers, seconds included."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("vllm:kvtier_"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def local_workers() -> list[WorkerSide]:
    """The connector workers of this process (single-process vLLM), from the lookup registry."""
    from kvtier.integrations.vllm import lookup
    from kvtier.integrations.vllm.worker import WorkerSide

    with lookup._registry_lock:
        return [w for w in lookup._registry.values() if isinstance(w, WorkerSide)]


def local_load_s() -> float:
    """Seconds the connector workers of this process have spent on loads so far (0 without one):
    each round's growth is its `load_s` (single-process vLLM only)."""
    return sum(float(w.counter_snapshot().get("load_s", 0.0)) for w in local_workers())


def close_local_workers() -> dict[str, object]:
    """Closes the connector workers of this process (single-process vLLM: their saves finish and
    the SSD tier is made durable); ``{"stats": ...}`` of the last one, or nothing without one."""
    out: dict[str, object] = {}
    for worker in local_workers():
        worker.close()
        out["stats"] = worker.stats()
    return out


if __name__ == "__main__":
    main()
