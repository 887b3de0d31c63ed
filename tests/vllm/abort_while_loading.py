"""Drives a real single-process vLLM into case (a)+(b) of docs/vllm.md "Block lifetimes": a request
saved, preempted (vLLM's `reset_prefix_cache(reset_running_requests=True)` preempts every running
request), resumed with an async load (`load_async`) and aborted while that load runs. The load is
kept running by holding back the worker engine's completion reports (`TransferEngine.finished`)
until the abort has been processed: a load slower than a step. Prints one `RESULT <json>` line:
whether vLLM still held the request (its blocks) while the load ran, and whether it let go after.

Usage: python abort_while_loading.py '<json: model, prompt (text), connector>'
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvtier.integrations.vllm import lookup
    from kvtier.integrations.vllm.config import transfer_config
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        kv_transfer_config=transfer_config(spec["connector"]),
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    (endpoint,) = lookup._registry.values()
    worker: Any = endpoint
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = llm.get_tokenizer().encode(spec["prompt"])
    engine.add_request("a", {"prompt_token_ids": prompt}, params)
    for _ in range(3):  # prefill (its blocks are saved) and two decode steps
        engine.step()
    (rid,) = scheduler.requests  # vLLM's internal id ("a" plus a suffix)
    held = {"on": False}
    engine_finished = worker.engine.finished
    worker.engine.finished = lambda: [] if held["on"] else engine_finished()
    held["on"] = True
    scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts "a": drain, blocks freed
    engine.step()  # "a" resumes: a kvtier hit, loaded between steps
    resumed = scheduler.requests[rid].status.name
    engine.abort_request(["a"])
    engine.step()  # get_finished sees "a" finished while its load runs
    loading = sorted(s.req_id for job in worker._async_running for s in job.specs)
    kept = rid in scheduler.requests
    held["on"] = False
    deadline = time.monotonic() + 300  # the copy may be slow: torch's threads share two cores
    while rid in scheduler.requests and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    result = {
        "resumed_status": resumed,
        "loading_after_abort": [r == rid for r in loading],
        "kept_while_loading": kept,
        "released_after_load": rid not in scheduler.requests,
        "stats": worker.stats(),
    }
    worker.engine.finished = engine_finished
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
