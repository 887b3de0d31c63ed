"""StoreConfig fields from an engine's extra config (vLLM's `kv_connector_extra_config`, SGLang's
`--hicache-storage-backend-extra-config`); no engine import here.

The extra config holds `StoreConfig` fields, or `config_file` naming a kvtier YAML file of them
(inline fields win), beside the integration's own options. The engine decides what the KV bytes
mean (geometry, rank), so those keys are refused. Every bad key is a `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig, read_yaml
from kvtier.errors import ConfigError


def store_fields(
    extra: Mapping[str, Any],
    config_file: object,
    *,
    source: str,
    engine: str,
    from_engine: tuple[str, ...],
    option_names: Iterable[str],
    options_label: str,
) -> dict[str, Any]:
    """The StoreConfig fields of ``extra`` (the extra config with the integration's options
    already taken out) over those of ``config_file`` (a YAML path, or None).

    ``source`` names the extra config and ``engine`` the engine in messages; ``from_engine`` are
    fields the engine decides; ``option_names`` and ``options_label`` describe the integration's
    own keys when an unknown key is reported."""
    for key in from_engine:
        if key in extra:
            raise ConfigError(f"{source} sets `{key}`; {engine} decides it (from the model and its KV cache)")
    fields: dict[str, Any] = {}
    if config_file is not None:
        if not isinstance(config_file, str | Path):
            raise ConfigError(f"`config_file` is {config_file!r}; expected a path to a kvtier YAML file")
        data = read_yaml(config_file, "kvtier config_file")
        if isinstance(data, Mapping) and set(data) == {"store"}:
            data = data["store"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"`config_file` {str(config_file)!r} must hold a mapping of StoreConfig fields")
        fields.update(data)
        for key in from_engine:
            if key in fields:
                raise ConfigError(f"`config_file` {str(config_file)!r} sets `{key}`; {engine} decides it")
    fields.update(extra)
    known = {f.name for f in dataclasses.fields(StoreConfig) if f.init} - set(from_engine)
    unknown = sorted(set(fields) - known, key=repr)
    if unknown:
        raise ConfigError(
            f"unknown {source} key(s) {unknown}; expected StoreConfig fields "
            f"{sorted(known)} or {options_label} {sorted(option_names)}"
        )
    return fields
