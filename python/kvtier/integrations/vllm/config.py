"""The connector's settings, read from vLLM's `kv_connector_extra_config` (no vLLM import here).

The extra config holds `StoreConfig` keys (nested sections: `{"dram": {"capacity_bytes": "8GiB"}}`),
or `config_file` naming a kvtier YAML file with them, plus a few connector options
(:class:`ConnectorOptions`); all of them parse through kvtier's one config schema. vLLM decides the geometry (from the model and the KV cache), the
model id (its model name, revision, TP size and KV layout) and the rank, so those keys are refused:
two engines can then share a tier only when their KV bytes mean the same thing. Every bad key or
value is a `ConfigError` naming it, raised while vLLM starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError, shown
from kvtier.geometry import Geometry
from kvtier.integrations._config import StoreKeys, store_fields
from kvtier.schema import Section, boolean, choice, key, optional, seconds, text

# Decided by vLLM, not by the user.
FROM_ENGINE = ("geometry", "rank")
# vLLM dtype names -> kvtier's.
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def transfer_config(extra: Mapping[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that loads this connector with ``extra`` as its
    ``kv_connector_extra_config`` (what ``--kv-transfer-config`` takes, as a mapping)."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def _layerwise(value: Any, path: str) -> bool | None:
    if not isinstance(value, bool) and value != "auto":
        raise ConfigError(f'`{path}` is {shown(value)}; expected true, false or "auto"')
    return None if value == "auto" else value


@dataclass(frozen=True, kw_only=True)
class ConnectorOptions(Section):
    """The connector's own options, beside the StoreConfig keys."""

    LABEL: ClassVar[str] = "connector options"
    #: A kvtier YAML file of StoreConfig keys (merged under the inline ones).
    config_file: str | None = key(optional(text(nonempty=True, what="a path to a kvtier YAML file")), None)
    #: Scheduler -> worker lookup round trip; past it the lookup is a miss.
    lookup_timeout_s: float = key(seconds(0, 600), 5.0)
    #: true: start_load_kv returns at once, each layer waits for its own blocks; false: loads
    #: finish in start_load_kv; "auto" (None here): layerwise where the KV cache is not in host
    #: memory (on a CPU engine the copy competes with the forward for the same cores:
    #: docs/benchmarks.md, 2026-11-26).
    layerwise: bool | None = key(_layerwise, "auto")
    #: true: a hit is loaded between steps (vLLM's asynchronous load: the request waits in
    #: WAITING_FOR_REMOTE_KVS while the others keep running); false: within the step that needs it.
    load_async: bool = key(boolean(), False)
    #: vLLM's kv_load_failure_policy: a failed block is recomputed, or the request fails.
    load_failure_policy: str = key(choice("recompute", "fail"), "recompute")
    #: The worker writes its counters here (JSON) after each step that moved them.
    stats_file: str | None = key(optional(text(what="a path")), None)


@dataclass(frozen=True)
class ConnectorSettings:
    store_keys: StoreKeys
    lookup_timeout_s: float
    layerwise: bool | None  # None: decided by where vLLM's KV cache lives (`resolve_layerwise`)
    load_async: bool
    load_failure_policy: str
    stats_file: str | None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        names = ConnectorOptions.names()
        options = ConnectorOptions.from_dict({k: extra.pop(k) for k in names if k in extra})
        keys = store_fields(
            extra,
            options.config_file,
            source="kv_connector_extra_config",
            engine="vLLM",
            from_engine=FROM_ENGINE,
            option_names=names,
            options_label="connector options",
        )
        return cls(
            store_keys=keys,
            lookup_timeout_s=options.lookup_timeout_s,
            layerwise=options.layerwise,
            load_async=options.load_async,
            load_failure_policy=options.load_failure_policy,
            stats_file=options.stats_file,
        )

    def resolve_layerwise(self, device_type: str) -> bool:
        """Whether loads are layerwise for a KV cache on `device_type` ("cpu", "cuda", ...)."""
        return self.layerwise if self.layerwise is not None else device_type != "cpu"

    def store_config(
        self,
        geometry: Geometry,
        model: str,
        revision: str | None,
        variant: str,
        tp_size: int,
        layout: str,
        rank: int,
    ) -> StoreConfig:
        """The worker's StoreConfig. A user `model_id` stands for vLLM's model name (to share KV
        between two paths of the same weights); revision, variant (see :func:`model_variant`),
        TP size and layout stay in the id."""
        fields = self.store_keys.sections()
        user_model = fields.pop("model_id", None)
        if user_model is not None and (not isinstance(user_model, str) or not user_model):
            raise ConfigError(f"`model_id` is {user_model!r}; expected a non-empty string")
        # A serving process commits its DRAM tier at start (as LMCache pins its buffer): first-touch
        # page faults ran at 0.8 GB/s on the 2-core VM, so a 4K-token save into fresh arena pages
        # took 230 ms instead of 10, and the next request's lookup waited for it.
        if isinstance(fields.setdefault("dram", {}), dict):
            fields["dram"].setdefault("prefault", True)
        ssd = fields.get("ssd")
        if tp_size > 1 and isinstance(ssd, dict) and ssd.get("directory") is not None:
            # An SSD pool is opened by one process: each rank's worker gets its own under the
            # directory (the connector creates it), holding that rank's shard of every block.
            if ssd.get("devices"):
                raise self.store_keys.error(
                    "`ssd.devices` with tensor_parallel_size > 1: each TP rank opens its own SSD pool, "
                    "so one device list cannot serve them; use `ssd.directory` alone (a pool per rank "
                    "under it)"
                )
            ssd["directory"] = str(Path(str(ssd["directory"])) / f"rank{rank}")
        port = fields.get("metrics_port")
        if tp_size > 1 and isinstance(port, int) and not isinstance(port, bool):
            # One metrics endpoint per rank's store (each in its own worker process): port + rank.
            fields["metrics_port"] = port + rank
        fields["geometry"] = geometry.to_dict()
        fields["model_id"] = model_fingerprint(user_model or model, revision, tp_size, layout, variant)
        fields["rank"] = rank
        return self.store_keys.build(fields)


def per_rank_path(path: str | None, rank: int, tp_size: int) -> str | None:
    """A file each TP rank writes (`stats_file`): the path itself with one rank, else
    `name.rank<r>.ext` beside it (stats.json -> stats.rank1.json)."""
    if path is None or tp_size <= 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def geometry_for(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_tokens: int
) -> Geometry:
    """kvtier's Geometry for one TP rank's KV of a vLLM model (`dtype` as vLLM names it)."""
    name = dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"vLLM KV cache dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    return Geometry(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=DTYPES[name],
        block_tokens=block_tokens,
    )


def check_parallelism(pipeline: int, decode_context: int, prefill_context: int) -> None:
    """Refuses (ConfigError, at start) the parallel layouts whose KV the namespace cannot tell
    apart. Pipeline stages: each stage's worker holds other layers under the same TP rank (the
    same geometry when the layers split evenly), so stage 1 would find stage 0's blocks in a
    tier both reach (and the ranks' lookup channels would collide). Context parallelism (decode
    or prefill): a rank's block holds only some of the block's tokens, not what its key names."""
    for name, size in (
        ("pipeline_parallel_size", pipeline),
        ("decode_context_parallel_size", decode_context),
        ("prefill_context_parallel_size", prefill_context),
    ):
        if size != 1:
            raise ConfigError(
                f"vLLM runs with {name}={size}; kvtier's connector keys KV per TP rank only, "
                "so it supports tensor parallelism alone (docs/vllm.md, Limits)"
            )


def model_fingerprint(model: str, revision: str | None, tp_size: int, layout: str, variant: str = "") -> str:
    """The namespace's model id: KV from another model, revision, variant (quantization, RoPE or
    config overrides: the same weights computing other KV), TP split or layout never matches."""
    out = f"{model}|rev={revision or '-'}|tp={tp_size}|layout={layout}"
    return f"{out}|variant={variant}" if variant else out


def model_variant(
    quantization: object, rope: object, overrides: object, computed_in: str | None = None
) -> str:
    """A short digest of what changes a model's KV without changing its name: the quantization
    method, the RoPE settings (scaling, theta), any config overrides, and the dtype the model
    computes in when its KV cache has another one (`computed_in`: float32 activations rounded
    to a bfloat16 cache are not a bfloat16 model's KV). Empty when all are unset, so plain
    models keep their ids."""
    if not quantization and not rope and not overrides and not computed_in:
        return ""
    parts: list[object] = [str(quantization or ""), rope, overrides]
    if computed_in:
        parts.append(f"computed_in={computed_in}")
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def request_extra(cache_salt: str | None, lora_name: str | None, lora_path: str | None = None) -> bytes:
    """Bytes mixed into every block key of a request: its tenant salt and LoRA adapter (name and
    path: a name may be given to another adapter after a restart, while the stored KV stays).
    Each part is length-prefixed, so no salt can spell another salt and adapter."""
    if not cache_salt and not lora_name:
        return b""
    out = bytearray(b"kvtier-request-extra-v2")
    for part in (cache_salt or "", lora_name or "", lora_path or ""):
        data = part.encode("utf-8", "surrogatepass")  # any Python str, never an error in the scheduler
        out += len(data).to_bytes(4, "little") + data
    return bytes(out)
