"""``kvtier sim calibrate``'s measurements: the reference engine's step times, for the simulator's
fitted cost model.

Runs the engine's loop (``fcfs``, chunked prefill, continuous batching) on a calibration workload
of random-token requests in two waves and logs every step's batch shape and wall time (policy,
view, forward pass and sampling included); also times standalone forward passes over a grid of
shapes. :mod:`kvtier.sim.calibrate` fits :class:`kvtier.sim.cost.FittedCostModel` to them: the
engine depends on the simulator's fit, never the other way round (issue 18).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.engine.config import EngineConfig
from kvtier.engine.kv import PagedKvPool, pool_geometry
from kvtier.engine.model import Model, greedy_generate, load_model
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Engine
from kvtier.errors import ConfigError
from kvtier.sched import make_policy
from kvtier.sim.calibrate import DEFAULT_SHAPES, QUICK_SHAPES, Calibration, Sample, report, summary, write
from kvtier.sim.cost import BatchShape, PrefillChunk

__all__ = [
    "calibrate", "engine_run_samples", "logged_samples", "measure_engine_steps", "summary", "warm_up", "write",
]  # fmt: skip


def measure_engine_steps(
    model: Model,
    shapes: Sequence[BatchShape],
    *,
    repeats: int = 3,
    block_tokens: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """Best-of-``repeats`` wall time of one :meth:`Model.forward` per shape, over a paged pool."""
    if repeats < 1:
        raise ConfigError(f"repeats is {repeats}; expected >= 1")
    geometry = pool_geometry(model.config, block_tokens)
    rng = np.random.default_rng(0)
    samples = []
    for i, shape in enumerate(shapes):
        seqs = [(c.new_tokens, c.context_tokens) for c in shape.prefills]
        seqs += [(1, ctx - 1) for ctx in shape.decode_context_tokens]  # the simulator's context
        needs = [-(-(new + ctx) // block_tokens) for new, ctx in seqs]
        pool = PagedKvPool(geometry, sum(needs))
        tables, first = [], 0
        for n in needs:
            tables.append(list(range(first, first + n)))
            first += n
        ids = rng.integers(0, model.config.vocab_size, size=sum(new for new, _ in seqs))
        positions = np.concatenate([np.arange(ctx, ctx + new) for new, ctx in seqs])
        best = float("inf")
        for attempt in range(repeats + 1):  # the first run warms caches and is not counted
            access = pool.step(tables, [new + ctx for new, ctx in seqs], [new for new, _ in seqs])
            start = time.perf_counter()
            model.forward(ids, positions, access)
            if attempt:
                best = min(best, time.perf_counter() - start)
        samples.append(Sample(shape, best))
        if progress is not None:
            progress(i + 1, len(shapes))
    return samples


def warm_up(model: Model) -> None:
    """One short prefill and decode, so the first timed step does not pay for first-use costs
    (BLAS buffers, page faults on the weights): about 1 s on this machine."""
    greedy_generate(model, [[1] * 48, [2] * 24], 3)


def engine_run_samples(
    model: Model,
    *,
    quick: bool = False,
    seed: int = 1,
    engine_config: EngineConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """Step times of the real engine loop (policy, view, admission, forward, sampling: everything a
    step costs) on a calibration workload of random-token prompts: a first wave of requests, then a
    second wave sent as the first requests finish, so the log holds prefill-only, decode-only and
    mixed steps at many batch sizes and context lengths."""
    warm_up(model)
    rng = np.random.default_rng(seed)
    count, longest = (4, 96) if quick else (16, 900)
    # Log-uniform prompt lengths: decode steps then run at short and long contexts alike, so the
    # per-sequence and per-context costs can be told apart.
    lengths = np.exp(rng.uniform(np.log(16), np.log(longest), size=count)).astype(int)
    replies = rng.integers(4, 12 if quick else 64, size=count)
    config = engine_config or EngineConfig(num_blocks=1024, max_batch_tokens=256, max_running=16)
    engine = Engine(model, make_policy("fcfs"), config)
    engine.step_log = []
    vocab = model.config.vocab_size

    def send(i: int) -> None:
        prompt = rng.integers(0, vocab, size=int(lengths[i])).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=int(replies[i]), ignore_eos=True))

    first_wave = count // 2
    for i in range(first_wave):
        send(i)
    sent, done = first_wave, 0
    while engine.has_unfinished():
        engine.step()
        for _ in engine.pop_finished():
            done += 1
            if progress is not None:
                progress(done, count)
            if sent < count:
                send(sent)
                sent += 1
    return logged_samples(engine)


def logged_samples(engine: Engine) -> list[Sample]:
    """The engine's :attr:`~kvtier.engine.scheduler.Engine.step_log` as :class:`Sample` s (empty if
    it logged nothing), in the simulator's terms: a decode's context counts the token it decodes
    (the engine logs the tokens already in KV, one fewer); a prefill chunk's is its computed tokens
    on both sides."""
    return [
        Sample(
            BatchShape(tuple(PrefillChunk(n, c) for n, c in prefills), tuple(c + 1 for c in decodes)), seconds
        )
        for prefills, decodes, seconds in engine.step_log or ()
    ]


def calibrate(
    *,
    quick: bool = False,
    repeats: int = 3,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> Calibration:
    """Runs the calibration workload on the reference engine and times the standalone forward grid
    (:data:`~kvtier.sim.calibrate.DEFAULT_SHAPES`, or the quick one) on ``threads`` BLAS threads;
    returns :func:`kvtier.sim.calibrate.report` of them (coefficients, held-out error, grid)."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    model = load_model()
    kv_bytes = 2 * model.config.num_layers * model.config.kv_size * 4  # fp32 K and V per token
    with threadpool_limits(limits=threads, user_api="blas"):
        samples = engine_run_samples(model, quick=quick, progress=progress)
        grid = measure_engine_steps(model, QUICK_SHAPES if quick else DEFAULT_SHAPES, repeats=repeats)
    return report(
        samples,
        grid,
        kv_bytes_per_token=kv_bytes,
        num_layers=model.config.num_layers,
        model="SmolLM2-135M-Instruct (kvtier.engine, fp32 numpy)",
        blas_threads=threads,
    )
