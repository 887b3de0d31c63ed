"""Worker of `kvtier bench vllm`'s concurrent case: requests decode while a new request's hit loads.

Runs in the engine environment (`python -m kvtier.bench.vllm_concurrent @spec.json`), one vLLM
(single-process mode: scheduler, worker and connector in this process) per run. It starts the
spec's `background` requests (decoding `background_max_tokens` tokens each, EOS ignored), lets
them decode, then, one after the other, adds each `loaders` prompt (`max_tokens=1`: its first
token is its whole output) and steps the engine until that token arrives, with `gap_steps`
decode-only steps before each. It drives `LLMEngine.step()` itself and records the time each
token of each request arrived, so the caller (`kvtier.bench.vllm`) can read the background
requests' inter-token latency and throughput while a load was in flight, and each loader's TTFT.
Prints one `RESULT <json>` line.

`measure` (called by `kvtier.bench.vllm` in kvtier's own environment) runs that worker with the
connector's `load_async` false and true, alternating the order when repeated, and reads what a
serving user sees while a loader's hit loads: the background requests' decode throughput and
inter-token latency (ITL) in the window from the loader's arrival to its first token, and the
loader's TTFT, as ratios between the two modes measured in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, TypedDict

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.config import transfer_config
from kvtier.results import Result, field_of, json_text

MODES = {"sync": False, "async": True}  # the connector's load_async
KEYS = ("ttft_s", "bg_tokens_per_s", "bg_max_itl_s", "bg_mean_itl_s")  # compared between the modes


class Spec(TypedDict, total=False):
    """What the worker runs (JSON): the model, the prompts (token ids) and the connector's config."""

    model: str
    dtype: str
    max_model_len: int
    gpu_memory_utilization: float
    warm: list[int]
    background: list[list[int]]
    background_max_tokens: int
    gap_steps: int
    loaders: list[list[int]]
    connector: Mapping[str, object] | None  # the connector's config (kvtier's config keys)


class LoadRecord(TypedDict):
    t_add: float  # seconds since the worker's start
    t_first: float
    steps: int
    cached: int | None


class WorkerRun(TypedDict):
    """The worker's ``RESULT`` (JSON): each background request's token arrival times and each
    loader's window; ``stats`` is the connector's, passed through."""

    arrivals: dict[str, list[float]]
    loads: list[LoadRecord]
    stats: Mapping[str, object]


@dataclass(frozen=True)
class LoadWindow(Result):
    """One loader: its TTFT, and the background's decoding while it loaded."""

    ttft_s: float
    steps: int
    cached: int | None
    bg_tokens_per_s: float
    bg_max_itl_s: float
    bg_mean_itl_s: float


@dataclass(frozen=True)
class Windows:
    loads: list[LoadWindow]
    steady_itl_s: list[float]  # ITL gaps outside every loader's window


@dataclass(frozen=True)
class ModeFigures(Result):
    """One ``load_async`` mode: medians over every loader of every process."""

    ttft_s_median: float
    bg_tokens_per_s_median: float
    bg_max_itl_s_median: float
    bg_mean_itl_s_median: float
    bg_steady_itl_s_median: float | None
    per_load: list[LoadWindow]
    worker_stats: list[dict[str, object]]


@dataclass(frozen=True)
class Concurrent(Result):
    """What the concurrent case of ``kvtier bench vllm`` reports (under ``concurrent``)."""

    prefix_tokens: int
    background_requests: int
    loaders_per_process: int
    repeats: int
    tier: str
    modes: dict[str, ModeFigures]
    async_over_sync: dict[str, float]


def parse_run(data: Mapping[str, object], where: str = "vLLM concurrent worker's RESULT") -> WorkerRun:
    """The worker's RESULT (untrusted JSON) as a :class:`WorkerRun`; a :class:`KvtierError` names
    the missing or ill-typed field."""
    arrivals = field_of(data, "arrivals", dict, where)
    loads = field_of(data, "loads", list, where)
    out_loads: list[LoadRecord] = []
    for i, ld in enumerate(loads):
        if not isinstance(ld, dict):
            raise KvtierError(f"{where}: `loads[{i}]` is not an object")
        at = f"{where}: loads[{i}]"
        cached = ld.get("cached")
        if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool)):
            raise KvtierError(f"{at}: `cached` is {cached!r}; expected int or null")
        out_loads.append(
            LoadRecord(
                t_add=field_of(ld, "t_add", float, at),
                t_first=field_of(ld, "t_first", float, at),
                steps=field_of(ld, "steps", int, at),
                cached=cached,
            )
        )
    times = {str(name): field_of(arrivals, name, list, f"{where}: arrivals") for name in arrivals}
    out_arrivals: dict[str, list[float]] = {}
    for name, ts in times.items():
        bad = [t for t in ts if not isinstance(t, int | float) or isinstance(t, bool)]
        if bad:
            raise KvtierError(f"{where}: `arrivals[{name!r}]` holds {bad[0]!r}; expected seconds (numbers)")
        out_arrivals[name] = [float(t) for t in ts]
    stats = data.get("stats", {})
    if not isinstance(stats, dict):
        raise KvtierError(f"{where}: `stats` is not an object")
    return WorkerRun(arrivals=out_arrivals, loads=out_loads, stats=stats)


def window_metrics(result: WorkerRun) -> Windows:
    """Per loader: its TTFT, and the background requests' tokens/s and ITL gaps overlapping the
    window (arrival, first token]; plus the ITL gaps outside every window (steady decoding)."""
    arrivals: list[list[float]] = list(result["arrivals"].values())
    windows = [(float(ld["t_add"]), float(ld["t_first"])) for ld in result["loads"]]
    loads: list[LoadWindow] = []
    for (a, b), ld in zip(windows, result["loads"], strict=True):
        tokens = sum(1 for ts in arrivals for t in ts if a < t <= b)
        gaps = [c - p for ts in arrivals for p, c in pairwise(ts) if c > a and p < b]
        loads.append(
            LoadWindow(
                ttft_s=b - a,
                steps=ld["steps"],
                cached=ld["cached"],
                bg_tokens_per_s=tokens / (b - a),
                bg_max_itl_s=max(gaps, default=0.0),
                bg_mean_itl_s=statistics.fmean(gaps) if gaps else 0.0,
            )
        )
    steady = [
        c - p
        for ts in arrivals
        for p, c in pairwise(ts)
        if all(c <= a or p >= b for a, b in windows) and c > p
    ]
    return Windows(loads, steady)


def measure(
    worker: Callable[[Spec], Mapping[str, object]],
    spec: Spec,
    connector: Mapping[str, object],
    repeats: int,
    say: Callable[[str], None],
) -> Concurrent:
    """Runs `worker` (one fresh vLLM process each) per mode and repeat, ABBA order; the summary."""
    loads: dict[str, list[LoadWindow]] = {m: [] for m in MODES}
    steady: dict[str, list[float]] = {m: [] for m in MODES}
    stats: dict[str, list[dict[str, object]]] = {m: [] for m in MODES}
    order = list(MODES)
    for r in range(repeats):
        for mode in order if r % 2 == 0 else order[::-1]:
            say(f"concurrent: load_async {MODES[mode]} (fresh process: the prefix loads from SSD)")
            run_spec = spec.copy()
            run_spec["connector"] = {**connector, "load_async": MODES[mode]}
            res = parse_run(worker(run_spec))
            m = window_metrics(res)
            if not all(ld.cached for ld in m.loads):
                raise RuntimeError(f"a loader missed kvtier in mode {mode}: {m.loads}")
            loads[mode] += m.loads
            steady[mode] += m.steady_itl_s
            stats[mode].append({k: v for k, v in res["stats"].items() if k != "store"})

    def median(mode: str, key: str) -> float:
        return float(statistics.median(getattr(ld, key) for ld in loads[mode]))

    modes = {
        mode: ModeFigures(
            ttft_s_median=median(mode, "ttft_s"),
            bg_tokens_per_s_median=median(mode, "bg_tokens_per_s"),
            bg_max_itl_s_median=median(mode, "bg_max_itl_s"),
            bg_mean_itl_s_median=median(mode, "bg_mean_itl_s"),
            bg_steady_itl_s_median=statistics.median(steady[mode]) if steady[mode] else None,
            per_load=loads[mode],
            worker_stats=stats[mode],
        )
        for mode in MODES
    }
    return Concurrent(
        prefix_tokens=len(spec["loaders"][0]) - 16,
        background_requests=len(spec["background"]),
        loaders_per_process=len(spec["loaders"]),
        repeats=repeats,
        tier="ssd (fresh process, promotion off: every loader reads the SSD pool)",
        modes=modes,
        async_over_sync={k: median("async", k) / median("sync", k) for k in KEYS},
    )


def main() -> None:
    arg = sys.argv[1]
    spec: Spec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs: dict[str, object] = {}
    connector = spec.get("connector")
    if connector is not None:
        kwargs["kv_transfer_config"] = transfer_config(connector)
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        **kwargs,
    )
    llm.generate(
        [{"prompt_token_ids": spec["warm"]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    engine = llm.llm_engine
    t0 = time.perf_counter()
    arrivals: dict[str, list[float]] = {}
    cached: dict[str, int] = {}
    names: dict[str, str] = {}  # vLLM's request id -> ours

    def add(name: str, tokens: list[int], params: Any) -> None:
        arrivals[name] = []
        names[name] = name
        names[str(engine.add_request(name, {"prompt_token_ids": tokens}, params))] = name

    def step() -> None:
        outs = engine.step()
        t = time.perf_counter() - t0
        for o in outs:
            name = names.get(o.request_id, o.request_id)
            got = len(o.outputs[0].token_ids)
            seen = arrivals.setdefault(name, [])
            seen.extend([t] * (got - len(seen)))
            if o.num_cached_tokens is not None:
                cached[name] = int(o.num_cached_tokens)

    bg = SamplingParams(temperature=0, max_tokens=spec["background_max_tokens"], ignore_eos=True)
    background = [f"bg{i}" for i in range(len(spec["background"]))]
    for name, tokens in zip(background, spec["background"], strict=True):
        add(name, tokens, bg)
    while any(len(arrivals[b]) < 2 for b in background):  # all prefilled and decoding
        step()
    loads: list[LoadRecord] = []
    one = SamplingParams(temperature=0, max_tokens=1)
    for k, tokens in enumerate(spec["loaders"]):
        for _ in range(spec["gap_steps"]):
            step()
        name = f"load{k}"
        t_add = time.perf_counter() - t0
        add(name, tokens, one)
        steps = 0
        while not arrivals[name]:
            step()
            steps += 1
        loads.append(LoadRecord(t_add=t_add, t_first=arrivals[name][0], steps=steps, cached=cached.get(name)))
        if any(len(arrivals[b]) >= spec["background_max_tokens"] for b in background):
            raise RuntimeError("a background request finished during the run; raise background_max_tokens")
    for _ in range(spec["gap_steps"]):
        step()
    engine.abort_request([r for r, n in names.items() if n in background])
    result = WorkerRun(arrivals={b: arrivals[b] for b in background}, loads=loads, stats={})
    if spec.get("connector") is not None:
        from kvtier.integrations.vllm.run import close_local_workers

        stats = close_local_workers().get("stats")
        if isinstance(stats, dict):
            result["stats"] = stats
    print("RESULT " + json_text(result), flush=True)


if __name__ == "__main__":
    main()
