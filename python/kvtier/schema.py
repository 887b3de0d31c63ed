"""A small declarative schema for kvtier's configs: each setting is declared once, as a field of a
frozen dataclass with the check that parses it, and every error is a :class:`ConfigError` naming
the key path (``ssd.io_depth``) and the expected value.

pydantic v2 and msgspec were measured for this (issue 21): importing pydantic added ~75% to
``import kvtier`` and msgspec ~20% before a single schema was declared; this module adds nothing
(dataclasses are already imported) and keeps kvtier's error wording.

A :class:`Section` subclass declares its keys with :func:`key`::

    @dataclass(frozen=True)
    class SsdConfig(Section):
        PATH: ClassVar[str] = "ssd"
        directory: str = key(text())
        io_depth: int = key(integer(1, 256), 8)

and is built in code (``SsdConfig(directory="/d")``) or from a mapping (:meth:`Section.from_dict`,
unknown keys refused); a nested section is a field declared with :func:`section`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import PurePath
from typing import Any, ClassVar, Self, TypeVar

from kvtier.errors import ConfigError, did_you_mean, shown

#: Parses one value: ``(value, key path) -> normalised value``; raises :class:`ConfigError`.
Check = Callable[[Any, str], Any]
S = TypeVar("S", bound="Section")

#: Largest size any field takes (the Rust side holds sizes as ``u64``).
U64_MAX = 2**64 - 1
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*")
#: Most digits after the point a size string may have (each one is exact, none is rounded away).
_SIZE_FRACTION_DIGITS_MAX = 64


def parse_size(value: object, name: str, hi: int = U64_MAX) -> int:
    """Bytes from an int or a string such as ``"4GiB"`` or ``"1.5GB"`` (computed exactly, rounded
    down to whole bytes), at most ``hi``; raises :class:`ConfigError` naming ``name``."""
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m and m.group(3).lower() in _UNITS:
            whole, fraction = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
            if len(whole) > len(str(hi)):  # more digits than hi: too large (no huge int built)
                raise ConfigError(f"`{name}` is {shown(value)}; expected a size of at most {hi} bytes")
            if len(fraction) <= _SIZE_FRACTION_DIGITS_MAX:
                scale = 10 ** len(fraction)
                size = (
                    (int(whole or "0") * scale + int(fraction or "0")) * _UNITS[m.group(3).lower()] // scale
                )
    if size is None or size < 0:
        raise ConfigError(
            f"`{name}` is {shown(value)}; expected a size in bytes such as 4294967296 or '4GiB'"
        )
    if size > hi:
        raise ConfigError(f"`{name}` is {shown(value)}; expected a size of at most {hi} bytes")
    return size


# --- checks -------------------------------------------------------------------------------------


def size(lo: int = 0, hi: int = U64_MAX) -> Check:
    """Bytes, as an int or a string with a unit (:func:`parse_size`), in ``[lo, hi]``."""

    def check(value: Any, path: str) -> int:
        n = parse_size(value, path, hi)
        if n < lo:
            raise ConfigError(f"`{path}` is {shown(value)}; expected at least {lo} bytes")
        return n

    return check


def integer(lo: int, hi: int) -> Check:
    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"`{path}` is {shown(value)}; expected an int in [{lo}, {hi}]")
        return value

    return check


def seconds(lo: float, hi: float, lo_open: bool = True) -> Check:
    """A number of seconds in ``(lo, hi]`` (``[lo, hi]`` with ``lo_open=False``), as a float."""

    def check(value: Any, path: str) -> float:
        # Compared exactly, before any float conversion (a huge int would overflow it); NaN fails.
        ok = (
            not isinstance(value, bool)
            and isinstance(value, int | float)
            and (lo < value if lo_open else lo <= value)
            and value <= hi
        )
        if not ok:
            raise ConfigError(
                f"`{path}` is {shown(value)}; expected seconds in {'(' if lo_open else '['}{lo}, {hi}]"
            )
        return float(value)

    return check


def boolean() -> Check:
    def check(value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"`{path}` is {shown(value)}; expected true or false")
        return value

    return check


def choice(*choices: str) -> Check:
    def check(value: Any, path: str) -> str:
        if value not in choices:
            raise ConfigError(
                f"`{path}` is {shown(value)}{did_you_mean([value], choices)}; expected one of {list(choices)}"
            )
        return str(value)

    return check


def text(nonempty: bool = False, what: str = "a string") -> Check:
    """A string (a path object becomes its string); ``nonempty``: not ``""``."""

    def check(value: Any, path: str) -> str:
        if isinstance(value, PurePath):
            value = str(value)
        if not isinstance(value, str) or (nonempty and not value):
            raise ConfigError(f"`{path}` is {shown(value)}; expected {what}")
        return value

    return check


def optional(inner: Check) -> Check:
    """``None``, or what ``inner`` accepts."""

    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


def paths(most: int, noun: str = "path") -> Check:
    """A list of distinct, non-empty paths (at most ``most``), as a tuple of strings; ``noun``
    names one in messages."""

    def check(value: Any, path: str) -> tuple[str, ...]:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"`{path}` is {shown(value)}; expected a list of {noun} paths")
        out = tuple(str(d) if isinstance(d, PurePath) else d for d in value)
        for d in out:
            if not isinstance(d, str) or not d:
                raise ConfigError(f"`{path}` holds {shown(d)}; expected non-empty paths")
        if len(set(out)) != len(out):
            raise ConfigError(f"`{path}` lists a {noun} twice ({list(out)}); expected distinct {noun}s")
        if len(out) > most:
            raise ConfigError(f"`{path}` has {len(out)} {noun}s; expected at most {most}")
        return out

    return check


def section(cls: type[S], absent: S | None = None) -> Check:
    """A nested section: an instance of ``cls``, a mapping of its keys, or ``None`` (``absent``)."""

    def check(value: Any, path: str) -> S | None:
        if value is None:
            return absent
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ConfigError(f"`{path}` is {shown(value)}; expected a mapping of {cls.__name__} keys or None")

    return check


def key(check: Check, default: Any = MISSING, *, repr: bool = True, expected: str = "a value") -> Any:
    """A field of a :class:`Section`, parsed by ``check``; without ``default`` it is required, and
    ``expected`` says what it takes when it is missing."""
    return field(default=default, metadata={"check": check, "expected": expected}, repr=repr)


# --- sections -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """Base of a config section (a frozen dataclass whose fields are declared with :func:`key`):
    each field is parsed by its check at construction, then :meth:`check` sees the whole section."""

    #: The section's place in the config: key paths in errors are ``PATH.key`` (``ssd.io_depth``).
    PATH: ClassVar[str] = ""
    #: What the whole config is called in errors (a section is called by its ``PATH``).
    LABEL: ClassVar[str] = "config"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(getattr(self, f.name), self.key_path(f.name)))
        self.check()

    def check(self) -> None:
        """Checks between fields (each field is already parsed); raises :class:`ConfigError`."""

    @classmethod
    def key_path(cls, name: str) -> str:
        return f"{cls.PATH}.{name}" if cls.PATH else name

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """From a mapping of this section's keys; unknown and missing keys raise ConfigError."""
        if not isinstance(data, Mapping):
            what = f"`{cls.PATH}`" if cls.PATH else cls.LABEL
            raise ConfigError(f"{what} is {shown(data)}; expected a mapping of {cls.__name__} keys")
        cls.check_known(data)
        for f in dataclasses.fields(cls):
            if f.init and f.default is MISSING and f.default_factory is MISSING and f.name not in data:
                expected = f.metadata.get("expected", "a value")
                raise ConfigError(
                    f"`{cls.key_path(f.name)}` is missing; expected {expected} (it has no default)"
                )
        return cls(**data)

    @classmethod
    def check_known(cls, data: Mapping[Any, Any], also: Iterable[str] = ()) -> None:
        """Raises ConfigError for keys of ``data`` that are neither this section's nor in ``also``."""
        known = cls.names()
        unknown = sorted(set(data) - set(known) - set(also), key=repr)  # YAML keys may be ints, None
        if unknown:
            what = f"`{cls.PATH}` section" if cls.PATH else cls.LABEL
            raise ConfigError(
                f"unknown {what} key(s) {unknown}{did_you_mean(unknown, known)}; expected some of {sorted(known)}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The keys as plain data (tuples as lists, nested sections as mappings): from_dict's input."""
        return {name: _plain(getattr(self, name)) for name in self.names()}


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def nest_flat_keys(data: Mapping[str, Any], renames: Mapping[str, str], what: str) -> dict[str, Any]:
    """``data`` with each deprecated flat key of ``renames`` (``"ssd_io_depth" -> "ssd.io_depth"``)
    moved into its section, with a DeprecationWarning naming the new key. A key given both ways,
    or flat beside a section that is not a mapping, is a ConfigError."""
    out = dict(data)
    for old in [k for k in out if k in renames]:
        new = renames[old]
        sec, _, name = new.partition(".")
        warnings.warn(
            f"{what} key `{old}` is deprecated (it goes in the next release); use `{new}`",
            DeprecationWarning,
            stacklevel=_outside_kvtier(),
        )
        nested = out.get(sec)
        if isinstance(nested, Section):
            nested = nested.to_dict()
        if nested is None:
            nested = {}
        if not isinstance(nested, Mapping):
            raise ConfigError(f"`{old}` is given beside `{sec}` = {shown(nested)}; expected one of the two")
        if name in nested:
            raise ConfigError(f"`{old}` and `{new}` are both given; expected only `{new}`")
        out[sec] = {**nested, name: out.pop(old)}
    return out


def _outside_kvtier() -> int:
    """The ``stacklevel`` of the first caller outside the kvtier package (the user's line)."""
    package = os.path.dirname(__file__) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
