"""StoreConfig keys from an engine's extra config (vLLM's `kv_connector_extra_config`, SGLang's
`--hicache-storage-backend-extra-config`); no engine import here.

The extra config holds `StoreConfig` keys (nested: `{"dram": {"capacity_bytes": "8GiB"}, "ssd":
{...}}`; the flat keys of earlier releases still work for one release, with a DeprecationWarning),
or `config_file` naming a kvtier YAML file of them (inline keys win, section by section), beside
the integration's own options, which are a :class:`kvtier.schema.Section` of their own. The
engine decides what the KV bytes mean (geometry, rank), so those keys are refused. Every bad key
is a `ConfigError` naming it; values are checked by StoreConfig's schema.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig, flat_hint, nest_store_keys, read_yaml, with_flat_hint
from kvtier.errors import ConfigError, did_you_mean

#: The sections of a StoreConfig: a config file's and the inline ones are merged key by key.
SECTIONS = ("dram", "ssd", "remote")


@dataclass(frozen=True)
class StoreKeys:
    """An engine's StoreConfig keys, nested, and the deprecated flat keys they were given as."""

    fields: dict[str, Any]
    flat: tuple[str, ...] = ()

    def sections(self) -> dict[str, Any]:
        """A copy of ``fields`` whose section mappings are copies too (safe to change)."""
        return {k: dict(v) if k in SECTIONS and isinstance(v, Mapping) else v for k, v in self.fields.items()}

    def build(self, fields: Mapping[str, Any]) -> StoreConfig:
        """``StoreConfig.from_dict(fields)``; an error about a flat key's value names that key too."""
        return with_flat_hint(list(self.flat), lambda: StoreConfig.from_dict(fields))

    def error(self, message: str) -> ConfigError:
        """A ConfigError of ``message``, naming too the deprecated flat keys it is about."""
        return flat_hint(list(self.flat), ConfigError(message))


def store_fields(
    extra: Mapping[str, Any],
    config_file: object,
    *,
    source: str,
    engine: str,
    from_engine: tuple[str, ...],
    option_names: Iterable[str],
    options_label: str,
) -> StoreKeys:
    """The StoreConfig keys of ``extra`` (the extra config with the integration's options
    already taken out) over those of ``config_file`` (a YAML path, or None).

    ``source`` names the extra config and ``engine`` the engine in messages; ``from_engine`` are
    keys the engine decides; ``option_names`` and ``options_label`` describe the integration's
    own keys when an unknown key is reported."""
    for key in from_engine:
        if key in extra:
            raise ConfigError(f"{source} sets `{key}`; {engine} decides it (from the model and its KV cache)")
    fields: dict[str, Any] = {}
    flat: list[str] = []
    if config_file is not None:
        if not isinstance(config_file, str | Path):
            raise ConfigError(f"`config_file` is {config_file!r}; expected a path to a kvtier YAML file")
        data = read_yaml(config_file, "kvtier config_file")
        if isinstance(data, Mapping) and set(data) == {"store"}:
            data = data["store"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"`config_file` {str(config_file)!r} must hold a mapping of StoreConfig keys")
        for key in from_engine:
            if key in data:
                raise ConfigError(f"`config_file` {str(config_file)!r} sets `{key}`; {engine} decides it")
        fields, flat = nest_store_keys(data, f"config_file {str(config_file)!r}")
        _refuse_unknown(fields, f"`config_file` {str(config_file)!r}", from_engine)
    inline, inline_flat = nest_store_keys(extra, source)
    _refuse_unknown(inline, source, from_engine, sorted(option_names), options_label)
    for key, value in inline.items():
        below = fields.get(key)
        if key in SECTIONS and isinstance(value, Mapping) and isinstance(below, Mapping):
            value = {**below, **value}
        fields[key] = value
    return StoreKeys(fields, tuple(flat + inline_flat))


def _refuse_unknown(
    fields: Mapping[Any, Any],
    source: str,
    from_engine: tuple[str, ...],
    option_names: list[str] | None = None,
    options_label: str = "",
) -> None:
    """A ConfigError naming ``source`` and each key of ``fields`` that is no StoreConfig key (nor,
    where ``option_names`` is given, one of the integration's options), with the known key it
    resembles."""
    known = sorted(set(StoreConfig.names()) - set(from_engine))
    unknown = sorted(set(fields) - set(known), key=repr)
    if unknown:
        others = f" or {options_label} {option_names}" if option_names is not None else ""
        raise ConfigError(
            f"unknown {source} key(s) {unknown}{did_you_mean(unknown, [*known, *(option_names or ())])}; "
            f"expected StoreConfig keys {known}{others}"
        )
