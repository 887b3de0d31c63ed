"""The connector's counters as vLLM reports them (docs/metrics.md, "Inside vLLM").

The worker side (`worker.WorkerSide`) counts what it does in `counters`; vLLM asks the worker's
connector for stats after every step (`get_kv_connector_stats`), carries them to its front end
(another process by default), sums them over tensor-parallel workers and steps, and hands them to
the connector's Prometheus metrics (`prom.KvtierPromMetrics`), which vLLM serves on its own
`/metrics` (multi-process collection included). This module is that payload: which counters
cross, their help texts, and the per-step delta. It does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Counter name (as in `WorkerSide.counters`) -> help text. A name ending in `_s` is a total of
#: seconds; the others count events or blocks. Exported as `vllm:kvtier_<name>_total`, with
#: `_s` spelled `_seconds` (`metric_name`).
COUNTERS: Mapping[str, str] = {
    "lookups": "Prefix lookups the connector's workers answered for vLLM's scheduler.",
    "lookup_hit_blocks": "Blocks those lookups found in kvtier.",
    "lookup_s": "Seconds spent in kvtier lookups.",
    "lookup_save_wait_s": "Seconds lookups waited for earlier saves to finish.",
    "synchronous_jobs": "Load jobs finished before the forward started.",
    "layerwise_jobs": "Load jobs the forward waited on layer by layer.",
    "async_jobs": "Load jobs for requests waiting outside the forward (load_async).",
    "loads": "Requests' loads completed (one per request per load job).",
    "loaded_blocks": "Blocks loaded from kvtier into vLLM's KV cache.",
    "load_error_blocks": "Blocks whose load failed (a miss, checksum or decode failure): recomputed.",
    "load_exceptions": "Load jobs that raised (all their blocks reported as errors).",
    "load_s": "Seconds load jobs ran.",
    "load_wait_s": "Seconds the forward stood still waiting for loads.",
    "saves": "Save jobs finished.",
    "saved_blocks": "Blocks saved from vLLM's KV cache into kvtier.",
    "save_rejected": "Blocks a save offered that the store refused (full, or already stored).",
    "save_failed_blocks": "Blocks whose save failed.",
    "save_exceptions": "Save jobs that raised.",
    "saves_dropped_after_load_error": "Saves skipped because the request's load had failed.",
}


def metric_name(counter: str) -> str:
    """`loaded_blocks` -> `vllm:kvtier_loaded_blocks_total`; `load_s` -> `..._load_seconds_total`."""
    base = counter[:-2] + "_seconds" if counter.endswith("_s") else counter
    return f"vllm:kvtier_{base}_total"


def delta(now: Mapping[str, float], seen: Mapping[str, float]) -> dict[str, float]:
    """What grew since `seen`, for the exported counters only (zeros left out). A counter that went
    down (it never should) raises: a Prometheus counter cannot be lowered, and a silent clamp would
    hide the bug."""
    out: dict[str, float] = {}
    for name in COUNTERS:
        d = now.get(name, 0) - seen.get(name, 0)
        if d < 0:
            raise ValueError(f"connector counter {name!r} went down ({seen.get(name)} -> {now.get(name)})")
        if d:
            out[name] = d
    return out
