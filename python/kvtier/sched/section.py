"""The checks every data-plane section of a sim config shares (``swap``, ``fetch``, ``load``, ``io``,
``network``, ``offload``): it is a mapping, and it names only keys its parser knows; and the one
reader of a section that names a profile (``{engine: NAME, KEY: VALUE...}``). One home for the
messages."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

P = TypeVar("P")
D = TypeVar("D", bound="DataclassInstance")


def checked_section(name: str, section: object, known: Collection[str], example: str) -> Mapping[str, Any]:
    """``section`` as a mapping with keys from ``known`` (in their order in the message), else a
    :class:`ConfigError` naming the section, the bad value or keys, and an ``example``."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"sim `{name}` is {section!r}; expected a mapping such as {example}")
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown {name} key(s) {unknown}{did_you_mean(unknown, known)}; expected some of {list(known)}"
        )
    return section


def profile(kind: str, profiles: Mapping[str, P], name: object) -> P:
    """The profile named ``name`` in ``profiles`` (a ``kind`` section's ``engine``); else a
    :class:`ConfigError` naming the value and the known names."""
    if not isinstance(name, str):
        raise ConfigError(f"{kind} `engine` is {name!r}; expected one of {sorted(profiles)}")
    try:
        return profiles[name]
    except KeyError:
        raise ConfigError(
            f"unknown {kind} engine {name!r}{did_you_mean([name], profiles)}; expected one of {sorted(profiles)}"
        ) from None


def profile_section(
    kind: str,
    section: Mapping[str, Any] | None,
    profiles: Mapping[str, D],
    keys: Collection[str],
    default: str,
    example: str,
    adjust: Callable[[dict[str, Any]], None] | None = None,
) -> D:
    """The sim config's ``kind`` section as a profile: ``{engine: NAME, KEY: VALUE...}`` is the
    profile named ``NAME`` in ``profiles`` with the given ``keys`` (fields of the profiles'
    dataclass) changed; no section or no ``engine``: the profile named ``default``. ``adjust`` may
    rewrite the changes before they apply (a key that implies another)."""
    if section is None:
        return profile(kind, profiles, default)
    section = checked_section(kind, section, ("engine", *keys), example)
    base = profile(kind, profiles, section.get("engine", default))
    changes = {k: v for k, v in section.items() if k != "engine"}
    if adjust is not None:
        adjust(changes)
    try:
        return replace(base, **changes)
    except TypeError as e:  # a value its profile's checks cannot compare (a string for a rate)
        raise ConfigError(f"bad {kind} section {dict(section)!r}: {e}") from None
