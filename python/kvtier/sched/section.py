"""The checks every data-plane section of a sim config shares (``swap``, ``fetch``, ``network``):
it is a mapping, and it names only keys its parser knows. One home for the messages."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from kvtier.errors import ConfigError


def checked_section(name: str, section: object, known: Collection[str], example: str) -> Mapping[str, Any]:
    """``section`` as a mapping with keys from ``known`` (in their order in the message), else a
    :class:`ConfigError` naming the section, the bad value or keys, and an ``example``."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"sim `{name}` is {section!r}; expected a mapping such as {example}")
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise ConfigError(f"unknown {name} key(s) {unknown}; expected some of {list(known)}")
    return section
