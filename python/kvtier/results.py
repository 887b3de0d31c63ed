"""Typed results of kvtier's benchmarks and simulator (issue 18 step 5), and their one way to JSON.

Every JSON text kvtier writes (``--json`` output, result and stamp files, worker ``RESULT`` lines)
comes from :func:`json_text` (or :func:`write_json`, which uses it): strict JSON (RFC 8259), which
has no NaN or Infinity, so a non-finite float (a figure that is undefined, such as the mean TTFT of
no requests) is written as ``null``. Readers take ``null`` where a float is expected back as NaN:
:meth:`Result.from_json` for typed results, :func:`nan_for_null` for documents typed as a
``TypedDict`` (a ``kvtier sim run`` result), :func:`field_of` where its caller says a figure may be
undefined (``null_is_nan``). A file written before, with Python's ``NaN`` literals, still reads
(Python's json accepts them).

A result is a frozen dataclass deriving :class:`Result`; ``kvtier bench X --json`` prints
:func:`to_json` of it, which is :meth:`Result.as_dict` for a result, recursively: each field under
its own name, a field declared ``= field(default=None, metadata=OMIT)`` left out while it is ``None`` (a key that only some
results carry, such as a bench row's ``not_run``). Values that are JSON documents passed through
(a peer process's raw output, a config echoed back) stay mappings, typed as ``TypedDict`` where
their keys are known.

Untrusted JSON read back into a typed value (a worker process's ``RESULT`` line) goes through
:func:`field_of`, whose error names the document and the missing or ill-typed field; a result
whose fields are numbers, strings, booleans, other results and ``None`` reads itself back with
:meth:`Result.from_json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO, TypeVar

from kvtier.errors import KvtierError, shown

T = TypeVar("T")
RT = TypeVar("RT", bound="Result")
#: ``field(default=None, metadata=OMIT)``: :meth:`Result.as_dict` leaves the key out while ``None``.
OMIT: Mapping[str, bool] = MappingProxyType({"omit_if_none": True})


@dataclass(frozen=True)
class Result:
    """Base of a typed result; see the module docs."""

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = to_json(value)
        return out

    @classmethod
    def from_json(cls: type[RT], data: Mapping[str, object], where: str) -> RT:
        """The result whose :meth:`as_dict` ``data`` is (untrusted JSON, such as a worker's
        ``RESULT``): each field read by :func:`field_of` (a ``float`` that is null is NaN); a field
        typed ``X | None`` may be null (or absent, where ``OMIT``), and reads None then; a field
        typed as a result is read by its own ``from_json``. A
        :class:`KvtierError` names ``where`` and the field; a field of another type is refused."""
        hints = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
            if type(None) in options:
                if data.get(f.name) is None:
                    if f.name not in data and not f.metadata.get("omit_if_none"):
                        raise KvtierError(f"{where}: `{f.name}` is missing")
                    values[f.name] = None
                    continue
                options = tuple(o for o in options if o is not type(None))
            if len(options) != 1 or not isinstance(options[0], type):
                raise TypeError(f"{cls.__name__}.{f.name}: {kind} is not read from JSON")
            (one,) = options
            if issubclass(one, Result):
                values[f.name] = one.from_json(field_of(data, f.name, dict, where), f"{where}: {f.name}")
            elif one in (int, float, str, bool):
                values[f.name] = field_of(data, f.name, one, where, null_is_nan=True)
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: {kind} is not read from JSON")
        return cls(**values)


R = TypeVar("R", bound="Result | Mapping[str, Any]")


def emit(result: R, as_json: bool, summary: Callable[[R], str]) -> None:
    """Prints ``result`` as one JSON object (``--json``: :func:`json_text`, keys sorted) or as its
    ``summary``: what every ``kvtier`` command that reports a result ends with."""
    print(json_text(result, sort_keys=True) if as_json else summary(result))


def output_directory(path: str | None, flag: str) -> str | None:
    """``path`` when it is ``None`` (the command picks a temp dir) or an existing directory this
    process may write in; else a :class:`KvtierError` naming ``flag`` (before any work starts)."""
    if path is None:
        return None
    if not os.path.isdir(path):
        problem = "is not a directory" if os.path.exists(path) else "does not exist"
        raise KvtierError(f"{flag} {path!r} {problem}; expected an existing, writable directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise KvtierError(f"{flag} {path!r} is not writable; expected an existing, writable directory")
    return path


def output_file(path: str | None, flag: str) -> str | None:
    """``path`` when it is ``None`` or a file that can be created in an existing directory; else a
    :class:`KvtierError` naming ``flag`` (checked before the work whose result it will hold)."""
    if path is not None:
        if os.path.isdir(path):
            raise KvtierError(f"{flag} {path!r} is a directory; expected a file path")
        output_directory(os.path.dirname(path) or ".", f"{flag}'s directory")
        probe = _temp_path(Path(path))  # what replacing() will create: os.access passes for root,
        try:  # on read-only mounts and under ACLs, so try it before the work, not after
            probe.open("x").close()
            probe.unlink()
        except OSError as e:
            raise KvtierError(
                f"{flag} {path!r} cannot be written ({e.strerror}); expected a writable path"
            ) from None
    return path


def _temp_path(target: Path) -> Path:
    """The temp file :func:`replacing` writes ``target``'s content to, beside it."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """A text file whose content replaces ``path`` only once the block ends without an error: it
    is written under a temp name beside ``path`` and renamed over it. An interrupted or failed write
    (Ctrl-C, a full disk, a value that does not serialise) leaves the old file, or none, never part
    of the new one that looks like a result."""
    target = Path(path)
    temp = _temp_path(target)
    try:
        with temp.open("x", encoding="utf-8") as file:  # "x": created with the umask's mode
            yield file
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], value: object) -> None:
    """``value`` as indented JSON (keys sorted) at ``path``, whole or not at all (:func:`replacing`)."""
    with replacing(path) as file:
        file.write(json_text(value, indent=2, sort_keys=True))


def json_text(value: object, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """``value`` (:func:`to_json` of it) as strict JSON text: each NaN or infinite float as
    ``null`` (JSON has neither; JavaScript, Go and ``jq`` refuse Python's ``NaN``). The one way
    kvtier writes JSON (tests/test_results.py checks no other ``json.dump`` is left); a value that
    is still not JSON raises rather than writing something that is not."""
    return json.dumps(_finite(to_json(value)), indent=indent, sort_keys=sort_keys, allow_nan=False)


def _finite(value: object) -> object:
    """JSON data (:func:`to_json`'s) with each non-finite float as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(value: object) -> object:
    """``value`` as plain JSON data: results as their :meth:`Result.as_dict`, tuples as lists,
    mappings and lists converted item by item, everything else as it is."""
    if isinstance(value, Result):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


@dataclass(frozen=True)
class Spread(Result):
    """Median and range of one figure over a bench's rounds, with every round's value."""

    median: float
    min: float
    max: float
    rounds: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), list(values))


def field_of(
    data: Mapping[str, object], key: str, kind: type[T], where: str, *, null_is_nan: bool = False
) -> T:
    """``data[key]`` when it is a ``kind`` (an int is a float too; a bool is neither); else a
    :class:`KvtierError` naming ``where`` and ``key``. With ``null_is_nan``, a float that is null
    is NaN (how :func:`json_text` writes a figure that may be undefined); without, null is refused
    (a figure that is always defined, such as a worker's timing)."""
    if key not in data:
        raise KvtierError(f"{where}: `{key}` is missing")
    value = data[key]
    if null_is_nan and kind is float and value is None:
        value = math.nan
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise KvtierError(f"{where}: `{key}` is {shown(value)}; expected {kind.__name__}")
    return value


def nan_for_null(data: object, kind: object) -> object:
    """``data`` (JSON read back) with each null where ``kind`` has a plain ``float`` as NaN, what
    :func:`json_text` wrote for a non-finite float. ``kind`` is a ``TypedDict`` (its fields'
    annotations), ``float``, or a ``list`` or ``dict`` of one; a ``float | None`` stays None, and
    what ``kind`` does not describe is left as it is (checking it is the reader's)."""
    if kind is float:
        return math.nan if data is None else data
    args = typing.get_args(kind)
    if typing.get_origin(kind) is list and isinstance(data, list):
        return [nan_for_null(v, args[0]) for v in data]
    if typing.get_origin(kind) is dict and isinstance(data, dict):
        return {k: nan_for_null(v, args[1]) for k, v in data.items()}
    if typing.is_typeddict(kind) and isinstance(data, dict):
        hints = typing.get_type_hints(kind)  # NotRequired[X] as X
        return {k: nan_for_null(v, hints[k]) if k in hints else v for k, v in data.items()}
    return data
