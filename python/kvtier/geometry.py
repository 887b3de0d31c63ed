"""KV-cache geometry: the shape of a model's KV cache and the sizes derived from it.

Validation and sizes come from ``kvtier-core`` (Rust), so Python and Rust never disagree.
A *segment* is K (or V) of one layer of one block; a *block* is every layer's K and V for
``block_tokens`` tokens plus the extra KV groups of hybrid models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from kvtier import _core
from kvtier.errors import ConfigError, GeometryError, did_you_mean, shown


@dataclass(frozen=True)
class ExtraGroup:
    """An extra KV group of a hybrid model (sliding-window, Mamba state, MLA latent)."""

    name: str
    bytes_per_token: int


def _require_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GeometryError(
            f"geometry field `{name}` is {shown(value)} ({type(value).__name__}); expected an int"
        )
    if value < 1:
        raise GeometryError(f"geometry field `{name}` is {value}; expected at least 1")
    if value >= 2**32:
        raise GeometryError(f"geometry field `{name}` is {shown(value)}; expected less than 2**32")
    return value


class ExtraGroupDict(TypedDict):
    name: str
    bytes_per_token: int


class GeometryDict(TypedDict):
    """:meth:`Geometry.to_dict`: the fields :meth:`Geometry.from_dict` reads back (JSON-ready)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    extra_groups: list[ExtraGroupDict]


@dataclass(frozen=True)
class Geometry:
    """Validated KV geometry. Raises :class:`kvtier.errors.GeometryError` on bad values."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_tokens: int = 16
    extra_groups: tuple[ExtraGroup, ...] = ()
    _handle: _core.CoreGeometry = field(init=False, repr=False, compare=False)
    _sizes: _core.GeometrySizes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            _require_int(name, getattr(self, name))
        if not isinstance(self.dtype, str):
            raise GeometryError(f"geometry field `dtype` is {self.dtype!r}; expected a string such as 'bf16'")
        groups = tuple(self.extra_groups)
        for group in groups:
            if not isinstance(group, ExtraGroup):
                raise GeometryError(f"extra group {group!r} is not an ExtraGroup")
            _require_int(f"extra_groups[{group.name!r}].bytes_per_token", group.bytes_per_token)
        core = _core.CoreGeometry(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.block_tokens,
            [(g.name, g.bytes_per_token) for g in groups],
        )
        sizes = core.sizes()
        object.__setattr__(self, "extra_groups", groups)
        object.__setattr__(self, "dtype", sizes["dtype"])
        object.__setattr__(self, "_handle", core)
        object.__setattr__(self, "_sizes", sizes)

    @property
    def dtype_bytes(self) -> int:
        return int(self._sizes["dtype_bytes"])

    @property
    def segment_bytes(self) -> int:
        """Bytes of K (or V) of one layer of one block."""
        return int(self._sizes["segment_bytes"])

    @property
    def layer_block_bytes(self) -> int:
        return int(self._sizes["layer_block_bytes"])

    @property
    def kv_block_bytes(self) -> int:
        return int(self._sizes["kv_block_bytes"])

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored object (all layers and extra groups of one block)."""
        return int(self._sizes["block_bytes"])

    @property
    def bytes_per_token(self) -> int:
        return int(self._sizes["bytes_per_token"])

    def pool_bytes(self, num_blocks: int) -> int:
        """Bytes of a ``LayerFirst`` paged pool of ``num_blocks`` blocks."""
        return int(self._sizes["pool_bytes_per_block"]) * num_blocks

    def to_dict(self) -> GeometryDict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "extra_groups": [
                {"name": g.name, "bytes_per_token": g.bytes_per_token} for g in self.extra_groups
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> Geometry:
        """From a mapping of the fields above, or a preset name (see :data:`PRESETS`)."""
        if isinstance(data, str):
            return preset(data)
        if not isinstance(data, Mapping):
            raise ConfigError(f"geometry must be a mapping or a preset name; got {type(data).__name__}")
        known = {"num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "extra_groups", "preset"}
        unknown = sorted(set(data) - known, key=repr)  # YAML keys may be ints, None, ...
        if unknown:
            raise ConfigError(
                f"unknown geometry key(s) {unknown}{did_you_mean(unknown, known)}; expected some of {sorted(known)}"
            )
        fields = dict(data)
        base: dict[str, Any] = dict(preset(fields.pop("preset")).to_dict()) if "preset" in fields else {}
        base.update(fields)  # user config, checked by Geometry itself
        groups = tuple(_extra_group(g) for g in base.pop("extra_groups", ()))
        try:
            return cls(**base, extra_groups=groups)
        except TypeError as e:
            raise ConfigError(f"geometry is missing a field: {e}") from None

    @classmethod
    def llama3_8b(cls, block_tokens: int = 16) -> Geometry:
        """Llama-3-8B-like: 32 layers, 8 KV heads, head dim 128, bf16 (128 KiB per token)."""
        return cls(32, 8, 128, "bf16", block_tokens)


def _extra_group(data: object) -> ExtraGroup:
    if isinstance(data, ExtraGroup):
        return data
    if isinstance(data, Mapping) and set(data) == {"name", "bytes_per_token"}:
        return ExtraGroup(str(data["name"]), data["bytes_per_token"])
    raise ConfigError(f"extra group {data!r}; expected a mapping with keys 'name' and 'bytes_per_token'")


class _Preset(TypedDict):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


PRESETS: dict[str, _Preset] = {
    "llama-3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
    "llama-3-70b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
    "mistral-7b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
    "qwen2.5-14b": {"num_layers": 48, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
    "smollm2-135m": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "fp32"},
}


def preset(name: str, block_tokens: int = 16) -> Geometry:
    """A named geometry; raises :class:`ConfigError` naming the known presets."""
    try:
        fields = PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown geometry preset {name!r}{did_you_mean([name], PRESETS)}; expected one of {sorted(PRESETS)}"
        ) from None
    return Geometry(**fields, block_tokens=block_tokens)
