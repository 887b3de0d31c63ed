"""The backend's settings, read from SGLang's `--hicache-storage-backend-extra-config` (no SGLang or
torch import here).

The extra config holds SGLang's own keys (`backend_name`, `module_path`, `class_name`,
`interface_v1`, ...: taken by SGLang, ignored here), `StoreConfig` keys (nested sections:
`{"dram": {"capacity_bytes": "8GiB"}}`), or `config_file` naming a kvtier YAML file of them; all of
them parse through kvtier's one config schema. SGLang decides the geometry (from its host KV pool) and the rank, so
those keys are refused. Every bad key or value is a `ConfigError` naming it, raised when SGLang
constructs the backend, before any page moves.

The namespace keeps apart what must never be read across: the model (SGLang's model name, or a
`model_id` given here), the TP size and rank, the pipeline stage, the context-parallel rank and
the host pool's layout and dtype (for a uint8 pool, the fp8 format named by `kv_cache_dtype`:
SGLang keeps e4m3 and e5m2 KV alike as uint8, and e4m3 bytes read as e5m2 are other KV). MLA KV
is the same on every TP rank, so MLA pages leave out the TP rank and size: SGLang backs them up
from one writer rank (`is_storage_writer`), and the other ranks read that one copy through the
remote tier, so MLA with TP > 1 requires a `remote` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError
from kvtier.geometry import Geometry
from kvtier.integrations._config import StoreKeys, store_fields
from kvtier.schema import Section, choice, key, optional, text

SOURCE = "hicache-storage-backend-extra-config"
#: fp8 KV formats (SGLang's `--kv-cache-dtype` names; e4m3fnuz is ROCm's e4m3) -> kvtier dtypes.
#: SGLang keeps every one as uint8 in its pools, so the format is part of the namespace.
FP8_FORMATS = {"fp8_e4m3": "fp8_e4m3", "fp8_e4m3fnuz": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
# Keys SGLang reads (or adds) in the same extra config; they are not the backend's.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "file_storage_path",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


@dataclass(frozen=True, kw_only=True)
class BackendOptions(Section):
    """The backend's own options, beside the StoreConfig keys."""

    LABEL: ClassVar[str] = "backend options"
    #: A kvtier YAML file of StoreConfig keys (merged under the inline ones).
    config_file: str | None = key(optional(text(nonempty=True, what="a path to a kvtier YAML file")), None)
    #: The fp8 format of the KV (SGLang's `--kv-cache-dtype`): SGLang keeps fp8 KV of every
    #: format as uint8 in its host pool, so a uint8 pool is refused without it (host_pool.py).
    kv_cache_dtype: str | None = key(optional(choice(*FP8_FORMATS)), None)


# Decided by SGLang, not by the user.
FROM_ENGINE = ("geometry", "rank")
# A stand-in geometry that lets every other field be validated before SGLang's pool is known. Its
# dtype is the one every codec accepts (`quant` needs fp16): what depends on the pool's real dtype
# is checked when SGLang registers it.
_PROBE_GEOMETRY = Geometry(1, 1, 1, "fp16", 1)


@dataclass(frozen=True)
class Parallelism:
    """Where this backend sits in SGLang's parallel layout (from `HiCacheStorageConfig`)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_mla: bool = False
    #: The attention data-parallel rank (SGLang gives no size): with DP attention every DP rank
    #: is a process with the same `tp_rank` (attention-group-local) and the same KV, so it shares
    #: the namespace but needs its own SSD pool and metrics port.
    dp_rank: int = 0
    #: SGLang's ``tp_lcm_size`` where this rank's KV pages are stored as head shards (MHA pages in
    #: the ``page_head`` layout: the backend decides), so that deployments of every TP size that
    #: divides it share them: each page is ``tp_lcm_size // tp_size`` objects, one per virtual rank
    #: ``tp_rank * split + i`` of ``tp_lcm_size`` ranks, in a namespace without the TP size.
    tp_lcm_size: int | None = None

    def __post_init__(self) -> None:
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("cp_rank", "cp_size")):
            r, s = getattr(self, rank), getattr(self, size)
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (r, s))
            if not ok or not 0 <= r < s:
                raise ConfigError(f"SGLang gave {rank}={r!r}, {size}={s!r}; expected 0 <= {rank} < {size}")
        if isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int) or self.dp_rank < 0:
            raise ConfigError(f"SGLang gave dp_rank={self.dp_rank!r}; expected an int >= 0")
        lcm = self.tp_lcm_size
        if lcm is not None and (
            isinstance(lcm, bool) or not isinstance(lcm, int) or lcm < self.tp_size or lcm % self.tp_size
        ):
            raise ConfigError(
                f"SGLang gave tp_lcm_size={lcm!r} with tp_size={self.tp_size}; expected a multiple of tp_size"
            )
        if lcm is not None and self.is_mla:
            raise ConfigError("tp_lcm_size splits MHA heads; MLA pages are shared by every TP size already")

    @property
    def head_split(self) -> int:
        """Objects per KV page: ``tp_lcm_size // tp_size`` head shards, or 1 (the page whole)."""
        return 1 if self.tp_lcm_size is None else self.tp_lcm_size // self.tp_size

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        """The virtual ranks (of ``tp_lcm_size``) of this rank's head shards, in head order;
        empty where pages are stored whole."""
        if self.tp_lcm_size is None:
            return ()
        split = self.head_split
        return tuple(range(self.tp_rank * split, (self.tp_rank + 1) * split))

    @property
    def namespace_rank(self) -> int:
        """The namespace's rank: this TP rank's shard, or 0 for MLA (every rank holds the same KV)
        and for head shards (their virtual rank is in each key: :attr:`shard_ranks`)."""
        return 0 if self.is_mla or self.tp_lcm_size is not None else self.tp_rank

    @property
    def process_index(self) -> int:
        """This rank's index among all of SGLang's ranks (TP fastest, then PP, then CP, then DP)."""
        return self.tp_rank + self.tp_size * (
            self.pp_rank + self.pp_size * (self.cp_rank + self.cp_size * self.dp_rank)
        )

    @property
    def directory_name(self) -> str:
        """A per-process SSD subdirectory when SGLang runs several ranks (an SSD pool has one owner;
        DP rank 0 keeps the name it had before DP ranks were told apart)."""
        if (self.tp_size, self.pp_size, self.cp_size, self.dp_rank) == (1, 1, 1, 0):
            return ""
        name = f"tp{self.tp_rank}of{self.tp_size}-pp{self.pp_rank}of{self.pp_size}-cp{self.cp_rank}of{self.cp_size}"
        return f"{name}-dp{self.dp_rank}" if self.dp_rank else name


def namespace_model_id(model: str, parallel: Parallelism, layout_tag: str, pool: str | None = None) -> str:
    """The namespace's model id: another model, TP split (except MLA), pipeline stage,
    context-parallel rank, host layout or host pool never matches. The KV pool's id has no
    ``pool=`` part (the id it had before hybrid pools); every other pool's has its name. Head
    shards (``tp_lcm_size``) name the shard's split, ``lcm<N>``, not the TP size: every TP size
    that divides it meets there."""
    if parallel.is_mla:
        tp = "mla"
    elif parallel.tp_lcm_size is not None:
        tp = f"lcm{parallel.tp_lcm_size}"
    else:
        tp = str(parallel.tp_size)
    out = f"sglang|{model}|tp={tp}|layout={layout_tag}"
    if parallel.pp_size > 1:
        out += f"|pp={parallel.pp_rank}/{parallel.pp_size}"
    if parallel.cp_size > 1:
        out += f"|cp={parallel.cp_rank}/{parallel.cp_size}"
    if pool is not None:
        out += f"|pool={pool}"
    return out


@dataclass(frozen=True)
class PoolPart:
    """One of a hybrid model's host pools, sharing the backend's tiers with the others
    (``pools.store_configs``): its name (None: the KV pool) and its share of the DRAM and SSD
    capacities."""

    name: str | None
    dram_bytes: int
    ssd_bytes: int | None

    def __post_init__(self) -> None:
        name = self.name
        if name is not None and (
            not name or not all(c.isascii() and (c.isalnum() or c == "_") for c in name)
        ):
            raise ConfigError(f"SGLang host pool name {self.name!r}; expected letters, digits and '_'")


@dataclass(frozen=True)
class BackendSettings:
    store_keys: StoreKeys
    #: The fp8 format of the pool's bytes (`BackendOptions.kv_cache_dtype`), or None.
    kv_cache_dtype: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Validates every field now (against a stand-in geometry): a bad key or value is a
        `ConfigError` naming it when SGLang constructs the backend."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"{SOURCE} is {type(extra).__name__}; expected a JSON object")
        rest = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        names = BackendOptions.names()
        options = BackendOptions.from_dict({k: rest.pop(k) for k in names if k in rest})
        keys = store_fields(
            rest,
            options.config_file,
            source=SOURCE,
            engine="SGLang",
            from_engine=FROM_ENGINE,
            option_names=[*names, *sorted(SGLANG_KEYS)],
            options_label="backend or SGLang keys",
        )
        model = keys.fields.get("model_id")
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"`model_id` is {model!r}; expected a non-empty string")
        settings = cls(store_keys=keys, kv_cache_dtype=options.kv_cache_dtype)
        settings.store_config(_PROBE_GEOMETRY, "probe-model", Parallelism(), "probe", probe=True)
        return settings

    def store_config(
        self,
        geometry: Geometry,
        model: str | None,
        parallel: Parallelism,
        layout_tag: str,
        *,
        probe: bool = False,
        part: PoolPart | None = None,
    ) -> StoreConfig:
        """The StoreConfig of one backend. A user `model_id` stands for SGLang's model name (to
        share KV between two paths of the same weights); the parallel layout and the host layout
        stay in the id. With several ranks, each opens its own subdirectory of `ssd.directory`.
        With ``part``, the store of one of a hybrid model's other host pools (`PoolPart`)."""
        fields = self.store_keys.sections()
        user_model = fields.pop("model_id", None)
        name = user_model or model
        if not name:
            raise ConfigError(f"SGLang gave no model name; set `model_id` in the {SOURCE}")
        # A serving process commits its DRAM tier at start, as the vLLM connector does (first-touch
        # faults ran at 0.8 GB/s on the 2-core VM: batch_set into fresh pages was 0.40 of memcpy).
        if isinstance(fields.setdefault("dram", {}), dict):
            fields["dram"].setdefault("prefault", True)
        port = fields.get("metrics_port")
        if isinstance(port, int) and not isinstance(port, bool):
            # One metrics endpoint per process's store: port + the process's index over TP, PP, CP.
            fields["metrics_port"] = port + parallel.process_index
        fields["geometry"] = geometry.to_dict()
        fields["model_id"] = namespace_model_id(name, parallel, layout_tag, part.name if part else None)
        fields["rank"] = parallel.namespace_rank
        ssd = fields.get("ssd")
        directory = ssd.get("directory") if isinstance(ssd, dict) else None
        if isinstance(ssd, dict) and directory is not None and not probe:
            if parallel.directory_name:
                ssd["directory"] = str(_subdirectory(directory, parallel.directory_name, "this rank's"))
            if part is not None and part.name is not None:  # an SSD pool has one owner: its own
                ssd["directory"] = str(_subdirectory(ssd["directory"], f"pool-{part.name}", "a host pool's"))
        if part is not None:
            _apply_part(fields, part)
        return self.store_keys.build(fields)


def _subdirectory(directory: Any, name: str, whose: str) -> Path:
    """``directory/name``, created if missing (the parent must exist: a mistyped path is not)."""
    if not isinstance(directory, str | Path):
        raise ConfigError(f"`ssd.directory` is {directory!r}; expected a directory path")
    sub = Path(directory) / name
    try:
        sub.mkdir(exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"`ssd.directory` {str(directory)!r}: cannot create {whose} subdirectory "
            f"{sub.name!r}: {e.strerror or e}; expected an existing, writable directory"
        ) from None
    return sub


def _apply_part(fields: dict[str, Any], part: PoolPart) -> None:
    """One host pool's share of the tiers (`PoolPart`): its DRAM and SSD capacities, and for a
    pool other than KV its SSD pool in its own directory's file (`ssd.devices` hold the KV pool's)."""
    fields["dram"]["capacity_bytes"] = part.dram_bytes
    ssd = fields.get("ssd")
    if isinstance(ssd, dict) and part.ssd_bytes is not None:
        ssd["capacity_bytes"] = part.ssd_bytes
        if part.name is not None:
            ssd["devices"] = []
