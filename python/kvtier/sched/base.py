"""The scheduler interface shared by the simulator and the reference engine (DESIGN §5).

A policy reads a :class:`SchedulerView` — queues, free blocks, prefix hits per tier, cost
estimates — and returns a :class:`SchedulerDecision`. Nothing in the view is a simulator object, so
the same policy instance can drive the CPU reference engine. Policies are registered by name
(:func:`register`, :func:`make_policy`).
"""

from __future__ import annotations

import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvtier.errors import ConfigError, did_you_mean
from kvtier.sched.fetch_path import PLAIN_FETCH, FetchPath
from kvtier.sched.swap_copy import PLAIN_SWAP, SwapCopy
from kvtier.tiers import NO_TOKENS, PerTier, Tier


class Phase(StrEnum):
    WAITING = "waiting"
    FETCHING = "fetching"
    RUNNING = "running"
    SWAPPED = "swapped"


class LoadMode(StrEnum):
    """How a cached prefix reaches the device (see docs/simulator.md)."""

    SYNC = "sync"  # compute waits for the whole load (LMCache)
    LAYERWISE = "layerwise"  # layer l computes once its KV arrived (HiCache, Unified pool)
    ASYNC = "async"  # the request waits in the fetching queue; the step does not (ShadowServe, Strata)


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request as a policy sees it. Output length is unknown, as in a real engine."""

    req_id: int
    arrival_s: float
    phase: Phase
    prompt_tokens: int
    computed_tokens: int  # prompt tokens whose KV is on the device (computed or loaded)
    generated_tokens: int
    # Consecutive cached prefix of the prompt, by the fastest tier holding each part, in tokens
    # (`cached_tokens.host` or `cached_tokens[Tier.HOST]`). Blocks already computed are in
    # `computed_tokens`.
    cached_tokens: PerTier = NO_TOKENS
    in_queue_tokens: int = 0  # right after the cached prefix, being brought by a queued request
    in_flight_tokens: int = 0  # right after the cached prefix, being loaded or computed now
    # The prompt's block keys (prefix-tree path, one per `block_tokens` tokens; what a real engine
    # hashes its pages into). Lets a policy tell which requests share a context: Strata's in-queue
    # delay hits and bundle hits (§4.3.1-4.3.2). Empty where the engine does not expose them.
    block_keys: tuple[int, ...] = ()

    @property
    def loadable_tokens(self) -> int:
        """Cached tokens not on the device: what a load could bring."""
        return sum(self.cached_tokens[Tier.HOST :])

    @property
    def remaining_prefill_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens


class CostEstimates(Protocol):
    """Estimates a policy may use to weigh loading against computing."""

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float: ...

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        """Seconds to load ``tokens`` from ``tier`` in ``mode`` on idle links, over the engine's load
        path (its copy granularity: data-plane config, :mod:`kvtier.sched.load_path`)."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """What a policy sees of one engine at the start of a step.

    ``waiting`` is the queue's head in order; a simulated engine builds its entries as the policy
    reads them (a waiting request's view needs a prefix lookup), so it is valid only while the
    policy decides this step: read it inside :meth:`Policy.schedule`, never keep it.
    """

    now_s: float
    waiting: Sequence[RequestView]
    running: tuple[RequestView, ...]
    fetching: tuple[RequestView, ...]
    swapped: tuple[RequestView, ...]
    free_device_blocks: int
    # Host blocks a swap-out can take now: the swap space free (or held by cache that gives way to a
    # swap). None: no host tier, or unbounded.
    free_host_blocks: int | None
    block_tokens: int
    max_batch_tokens: int
    max_running: int
    num_layers: int
    cost: CostEstimates
    kv_bytes_per_token: int = 0  # raw KV bytes per token on one GPU, for sizing transfers (0: unknown)
    swap_copy: SwapCopy = PLAIN_SWAP  # how the engine's swaps move KV (data-plane config, not the policy's)
    fetch: FetchPath = PLAIN_FETCH  # how the engine's compressed loads move KV (data-plane config)
    # The engine streams a prefill's hit KV into per-layer buffers (DualPath's layerwise prefill,
    # data-plane config: kvtier.sched.kv_io), so a batch's KV need not fit the device at once.
    layerwise_prefill: bool = False


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Bring ``tokens`` of a request's cached prefix (beyond its device part) to the device.

    What to load, when and how urgently is the policy's; the copies that carry it (their granularity,
    the compute they slow) are the engine's load path (data-plane config, :mod:`kvtier.sched.load_path`).
    """

    req_id: int
    tokens: int
    mode: LoadMode
    priority: int = 1  # link priority class (0 is most urgent)
    target: Tier = Tier.DEVICE  # HOST: prefetch SSD/remote blocks into host memory only (Strata §4.3.3)
    # Fetch compressed (ShadowServe, CacheGen-Async): through the engine's fetch path (its ratio,
    # decoder stage, where decoding runs and how much that slows model compute: data-plane config,
    # SchedulerView.fetch), which the engine applies when it starts the fetch.
    compressed: bool = False


@dataclass(slots=True)
class SchedulerDecision:
    prefill: list[tuple[int, int]] = field(default_factory=list)  # (req_id, new tokens this step)
    decode: list[int] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    preempt: list[int] = field(default_factory=list)  # drop device KV, recompute later
    swap_out: list[int] = field(default_factory=list)
    swap_in: list[int] = field(default_factory=list)


class Policy(ABC):
    """A scheduling policy. Subclasses set ``name`` and implement :meth:`schedule`.

    What the engine keeps below the device is not the policy's: it is data-plane configuration (the
    sim config's ``offload: {mode: ...}``, the reference engine's ``EngineConfig.offload``; where
    they name none, the policy's paper's, :func:`kvtier.sched.data_plane.default_offload`).
    """

    name: ClassVar[str]
    # The inter-engine scheduler this policy needs (kvtier.sched.placement), by name; None: any router.
    global_scheduler: ClassVar[str | None] = None
    # Takes SuperInfer's transfer budget B_xfer as ``xfer_blocks`` (kvtier.sim.xfer gives a simulated
    # node's own where a config leaves it out). Declared, not read from the constructor's signature:
    # a class compiled by mypyc (kvtier.sim.compiled) has none.
    takes_xfer_blocks: ClassVar[bool] = False

    @abstractmethod
    def schedule(self, view: SchedulerView) -> SchedulerDecision: ...

    def steady_decode(self, view: SchedulerView) -> bool:
        """Whether :meth:`schedule` of ``view`` decodes every running request, in order, and
        orders nothing else, and would decide the same in every later view that differs from it
        only by the running requests' generated tokens (while none finishes or needs a new block).

        An explicit opt-in (default False): where True, the simulator plans such steps without
        calling :meth:`schedule` (decode fast-forward, :mod:`kvtier.sim.fast_forward`), so it
        must hold for this policy's state too. A subclass that redefines :meth:`schedule` does not
        inherit a True answer (:meth:`__init_subclass__`); it opts in again if it can.
        """
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "offload" in cls.__dict__:
            raise ConfigError(_offload_moved(f"policy class {cls.__name__} sets"))
        if "schedule" in cls.__dict__ and "steady_decode" not in cls.__dict__:
            cls.steady_decode = Policy.steady_decode  # type: ignore[method-assign]

    def params(self) -> dict[str, Any]:
        return {}

    if not TYPE_CHECKING:  # `offload` is gone (issue 18 step 4): using it fails, naming its new key

        @property
        def offload(self) -> str:
            raise AttributeError(_offload_moved(f"policy {self.name!r}: reading"))

        @offload.setter
        def offload(self, value: str) -> None:
            raise ConfigError(_offload_moved(f"policy {self.name!r} sets"))


def _offload_moved(who: str) -> str:
    """Why ``Policy.offload`` of earlier releases fails now (issue 18 step 4), naming its new home."""
    return (
        f"{who} `offload`, which is no longer the policy's: what the engine keeps below the device is "
        "the sim config's `offload: {mode: ...}` (the reference engine's EngineConfig.offload); "
        "per-policy defaults are kvtier.sched.data_plane.EVALUATED_ON"
    )


_REGISTRY: dict[str, type[Policy]] = {}
# Names kept for one release (issue 18): old name -> (the policy that decides the same, the sim
# config keys by section that hold the mechanism the old name carried).
_DEPRECATED: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}


def deprecated_name(old: str, new: str, config: dict[str, dict[str, Any]]) -> None:
    """Keeps ``old`` constructing policy ``new`` for one release, with a DeprecationWarning naming
    ``new`` and the config keys (``{section: {key: value}}``) that now hold the rest of ``old``."""
    if old in _REGISTRY or old in _DEPRECATED:
        raise ConfigError(f"policy name {old!r} registered twice")
    _DEPRECATED[old] = (new, config)


def renamed(name: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """The current policy name for ``name`` and the config keys the old name implied: ``(name,
    {})``, or (with a DeprecationWarning) what a deprecated name became."""
    if name not in _DEPRECATED:
        return name, {}
    new, config = _DEPRECATED[name]
    keys = ", ".join(f"{sec}.{k}: {v!r}" for sec, kv in config.items() for k, v in kv.items())
    warnings.warn(
        f"policy {name!r} is deprecated: use policy {new!r} with config {keys}",
        DeprecationWarning,
        stacklevel=3,
    )
    return new, config


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: makes a policy constructible by name; duplicate names raise."""
    name = cls.name
    if name in _REGISTRY:
        raise ConfigError(f"policy name {name!r} registered twice")
    _REGISTRY[name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name`` (what it declares without being built: its
    ``global_scheduler``); unknown names raise :class:`ConfigError` listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown policy {name!r}{did_you_mean([name], policy_names())}; expected one of {policy_names()}"
        ) from None


def check_policy_names(names: Iterable[str]) -> None:
    """Raises :class:`ConfigError` for the first of ``names`` that names no policy (a deprecated
    name is one, without its warning here): for a command that runs several, before the first."""
    for name in names:
        if name not in _DEPRECATED:
            policy_class(name)


def make_policy(name: str, **params: Any) -> Policy:
    """A new policy instance; unknown names raise :class:`ConfigError` listing the known ones."""
    name = renamed(name)[0]
    factory = policy_class(name)
    if "offload" in params:
        raise ConfigError(_offload_moved(f"policy {name!r} sets"))
    try:
        return factory(**params)
    except TypeError as e:
        raise ConfigError(
            _unknown_parameters(name, factory, params) or f"bad parameters for policy {name!r}: {e}"
        ) from None


def _unknown_parameters(name: str, factory: type[Policy], params: Mapping[str, Any]) -> str | None:
    """The message naming the parameters ``factory`` does not take (with the close match), or None
    where it takes them all, or takes any, or has no signature to read (a mypyc-compiled class)."""
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    unknown = sorted(set(params) - set(accepted))
    if not unknown or any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return None
    return (
        f"policy {name!r} has no parameter(s) {', '.join(f'`{k}`' for k in unknown)}"
        f"{did_you_mean(unknown, accepted)}; accepted: {', '.join(accepted) or 'none'}"
    )
