"""Does the calibrated simulator predict the reference engine? (``kvtier bench engine``'s
``sim_ttft_error`` and ``sim_tpot_error``, issue 9 item 7.)

A held-out multi-turn chat workload — none of its batch shapes is one the calibration timed — runs
for real on this engine (``fcfs``, chunked prefill, continuous batching, device prefix cache; each
conversation's next turn is sent the moment its previous reply finishes, and re-sends the whole
history). :mod:`kvtier.sim.validate` then runs the same requests in the simulator with the
``fitted`` cost model and the engine's sizes, and compares mean TTFT and TPOT, the engine's own
spread over repeated runs (the noise floor the errors are judged against), and the batch shapes
both ran (the model's error on the engine's own steps). The engine imports the simulator here,
never the other way round (issue 18).
"""

from __future__ import annotations

from kvtier.engine.calibrate import logged_samples, warm_up
from kvtier.engine.config import EngineConfig
from kvtier.engine.model import Model, load
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Engine
from kvtier.engine.tokenizer import Tokenizer
from kvtier.errors import ConfigError
from kvtier.sched import make_policy
from kvtier.sim.calibrate import Sample
from kvtier.sim.cost import BatchShape, read_calibration
from kvtier.sim.validate import Comparison, Turn, compare, simulate

QUESTIONS: tuple[tuple[str, ...], ...] = (
    (
        "Describe how a bicycle gear system works.",
        "Why do racing bikes have more gears?",
        "What about hills?",
    ),
    ("Suggest a name for a bakery.", "Make it sound French.", "Now a slogan for it."),
    ("What causes ocean tides?", "How often do they happen?", "Are they the same everywhere?"),
    ("Write a haiku about winter.", "Now one about spring.", "Which season do you prefer?"),
    ("How do vaccines train the immune system?", "What is a booster?", "Why are some yearly?"),
)


def run_engine(
    model: Model,
    tokenizer: Tokenizer,
    *,
    conversations: int,
    turns: int,
    reply_tokens: int,
    engine_config: EngineConfig,
    step_log: list[Sample] | None = None,
) -> list[Turn]:
    """The workload on the real engine (closed loop, zero think time); one :class:`Turn` per request.
    ``step_log``, a list, receives the engine's steps (batch shape and wall time)."""
    if not 1 <= conversations <= len(QUESTIONS) or not 1 <= turns <= len(QUESTIONS[0]):
        raise ConfigError(
            f"{conversations} conversations x {turns} turns; expected at most {len(QUESTIONS)} x {len(QUESTIONS[0])}"
        )
    if reply_tokens < 2:
        raise ConfigError(f"reply_tokens is {reply_tokens}; expected >= 2 (TPOT needs two tokens)")
    warm_up(model)
    engine = Engine(model, make_policy("fcfs"), engine_config)
    if step_log is not None:
        engine.step_log = []
    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    where: dict[int, tuple[int, int, int | None]] = {}  # req_id -> (conversation, turn, parent)
    for c in range(conversations):
        rid = engine.add_request(tokenizer.encode_instruct(QUESTIONS[c][0]), params)
        where[rid] = (c, 0, None)
    turns_out: list[Turn] = []
    while engine.has_unfinished():
        engine.step()
        for out in engine.pop_finished():
            c, t, parent = where[out.request_id]
            n = len(out.token_ids)
            turns_out.append(
                Turn(
                    out.request_id,
                    parent,
                    list(out.prompt_token_ids),
                    list(out.token_ids),
                    n,
                    out.ttft_s,
                    (out.latency_s - out.ttft_s) / (n - 1),
                )
            )
            if t + 1 < turns:
                follow = tokenizer.encode(f"\n{QUESTIONS[c][t + 1]}\n")
                rid = engine.add_request(list(out.prompt_token_ids) + list(out.token_ids) + follow, params)
                where[rid] = (c, t + 1, out.request_id)
    if step_log is not None:
        step_log.extend(logged_samples(engine))
    return sorted(turns_out, key=lambda x: x.req_id)


def validate(
    *,
    calibration: str = "cpu-smollm2-135m",
    conversations: int = 4,
    turns: int = 3,
    reply_tokens: int = 12,
    threads: int = 1,
    repeats: int = 3,
    model: Model | None = None,
    tokenizer: Tokenizer | None = None,
) -> Comparison:
    """Runs the held-out workload ``repeats`` times on the engine and once in the simulator; returns
    both, the errors against the engine's mean over the runs, and the engine's own spread."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    if repeats < 1:
        raise ConfigError(f"repeats is {repeats}; expected >= 1")
    # A bad name or file, or another engine's steps, is refused before the engine runs.
    fitted_to = read_calibration(calibration).get("engine")
    if fitted_to is not None:
        raise ConfigError(
            f"calibration {calibration} was fitted to {fitted_to.get('name', 'another engine')}'s steps, "
            "not the reference engine's; refit with `kvtier sim calibrate --out FILE`"
        )
    if model is None or tokenizer is None:
        model, tokenizer = load()
    config = EngineConfig(num_blocks=512, max_batch_tokens=256, max_running=16)
    runs: list[list[Turn]] = []
    engine_steps: list[Sample] = []
    with threadpool_limits(limits=threads, user_api="blas"):
        for i in range(repeats):
            log = engine_steps if i == 0 else None
            run = run_engine(
                model, tokenizer, conversations=conversations, turns=turns, reply_tokens=reply_tokens,
                engine_config=config, step_log=log,
            )  # fmt: skip
            runs.append(run)
    sim_steps: list[BatchShape] = []
    sim = simulate(runs[0], config, calibration, step_shapes=sim_steps)
    return compare(runs, sim, calibration, engine_steps=engine_steps, sim_steps=sim_steps)
