"""The machine a calibration was fitted on (issue 22): a fitted cost model's step times hold for
that CPU, core count, vector units and BLAS only, so ``kvtier sim calibrate`` records them and
every user of a calibration compares them with the machine it runs on.

A calibration fitted elsewhere (or one that records no machine, such as a file written before
kvtier recorded machines) still loads; its users say so and name the command that refits it here.

An engine that computes with torch (vLLM) adds its runtime to the fingerprint (:data:`RUNTIME`:
torch's version and thread count, as its worker process reports them: kvtier's core never imports
torch). Those fields are compared only where both sides know them: a validation that ran vLLM knows
them here, a simulation that merely loads the calibration does not.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import NotRequired, TypedDict

from kvtier.results import field_of

#: The fields whose difference makes step times not transfer (others are recorded for the reader).
COMPARED = ("cpu_model", "cores", "avx512f", "avx512_bf16", "blas", "numpy")
#: An engine runtime's fields (vLLM's torch), compared only when both fingerprints have them.
RUNTIME = ("torch", "torch_threads")


class Fingerprint(TypedDict):
    """A machine as a calibration file records it (YAML, read back by :func:`differences`)."""

    cpu_model: str
    cores: int
    avx512f: bool
    avx512_bf16: bool
    blas: str
    numpy: str
    python: str
    torch: NotRequired[str]  # RUNTIME: an engine's torch, where its worker reported it
    torch_threads: NotRequired[int]


REFIT = "kvtier sim calibrate --out my-calibration.yaml (then pass calibration: my-calibration.yaml)"


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "unknown", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        model = platform.processor() or "unknown"
    return model, flags


def _blas() -> str:
    import numpy as np

    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{info.get('name', 'unknown')} {info.get('version', '')}".strip()
    except Exception:  # an older numpy without dict output: the BLAS is unknown, not an error
        return "unknown"


def fingerprint(runtime: Mapping[str, object] | None = None) -> Fingerprint:
    """This machine, as a calibration records it; ``runtime``, the engine's :data:`RUNTIME` fields
    where it has them (reported by its worker), are added."""
    import numpy as np

    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    numpy_version = ".".join(np.__version__.split(".")[:2])
    out = Fingerprint(
        cpu_model=model,
        cores=cores,
        avx512f="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        blas=_blas(),
        numpy=numpy_version,
        python=platform.python_version(),
    )
    runtime = runtime or {}
    if "torch" in runtime:
        out["torch"] = field_of(runtime, "torch", str, "engine runtime")
    if "torch_threads" in runtime:
        out["torch_threads"] = field_of(runtime, "torch_threads", int, "engine runtime")
    return out


def differences(
    recorded: Mapping[str, object] | None, current: Mapping[str, object] | None = None
) -> list[str]:
    """How the machine a calibration recorded differs from this one (empty: the same kind)."""
    if not recorded:
        return ["the calibration records no machine (fitted before kvtier recorded machines)"]
    here = fingerprint() if current is None else current
    known = COMPARED + tuple(key for key in RUNTIME if key in recorded and key in here)
    return [
        f"{key}: {recorded.get(key)!r} there, {here.get(key)!r} here"
        for key in known
        if recorded.get(key) != here.get(key)
    ]
