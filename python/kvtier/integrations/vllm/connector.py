"""`KvtierConnector`: kvtier as a vLLM v1 KV connector (`KVConnectorBase_V1`); docs/vllm.md.

vLLM builds one connector in its scheduler (role SCHEDULER) and one per worker (role WORKER), in
one process or several. The scheduler side decides, per request, how many prompt tokens kvtier
can supply (asking the workers' stores through `lookup`), which blocks to load this step and which
newly full blocks to save, and sends that as `KvtierConnectorMetadata`. The worker side owns the
store and does the copies (`worker.WorkerSide`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.errors import ConfigError, LayoutError
from kvtier.integrations.vllm.config import (
    DTYPES,
    ConnectorSettings,
    check_parallelism,
    geometry_for,
    model_variant,
    per_rank_path,
    request_extra,
)
from kvtier.integrations.vllm.kv_layout import PagedKV, layout_tag
from kvtier.integrations.vllm.lookup import LookupClient, LookupServer
from kvtier.integrations.vllm.prom import KvtierConnectorStats, KvtierPromMetrics
from kvtier.integrations.vllm.stats import delta
from kvtier.integrations.vllm.worker import LoadSpec, SaveSpec, WorkerSide
from kvtier.store import Store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    #: Loads between steps (`load_async`): their requests are not in this step's forward.
    async_loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: Requests were preempted this step: their blocks are freed without waiting for their saves,
    #: so the workers drain every queued save before the step overwrites them.
    preempted: bool = False
    #: Requests whose saves in `saves` were planned after they finished (TP > 1: a loading
    #: step's saves wait until no rank reported a load error); the workers report them done.
    late_finished: set[str] = field(default_factory=set)


@dataclass
class _Req:
    """The scheduler's view of one running request."""

    request: Request
    extra: bytes
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks known to be in kvtier (loaded from it, or saved)
    computed: int = 0  # tokens with KV after the last scheduled step
    load: tuple[int, int] | None = None  # (first block, blocks) to load in the next step
    saves_issued: bool = False
    deferred: bool = False  # this step loads (TP > 1): its saves wait for the step's outcome


# A request that ended with these statuses had its last step's output accepted by vLLM.
_FINISHED_WITH_OUTPUT = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")


def _tokens(token_ids: Any, n: int) -> bytes:
    return np.asarray(token_ids[:n], dtype="<u4").tobytes()


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise LayoutError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


def _segments(t: torch.Tensor, num_blocks: int) -> list[np.ndarray]:
    """A layer's KV tensor as `(num_blocks, bytes)` uint8 views, one per contiguous segment."""
    if t.device.type != "cpu":
        raise ConfigError(
            f"kvtier's vLLM connector copies KV on the CPU platform; this cache is on {t.device} "
            "(the device copy path is not built yet: docs/vllm.md)"
        )
    if t.shape[0] == num_blocks:
        parts = [t]
    elif t.ndim >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        parts = [t[0], t[1]]
    else:
        raise LayoutError(f"KV cache of shape {tuple(t.shape)} has no block dimension of {num_blocks}")
    out = []
    for p in parts:
        if not p.is_contiguous():
            raise LayoutError(f"KV cache part of shape {tuple(p.shape)} is not contiguous")
        out.append(p.view(torch.uint8).numpy().reshape(num_blocks, -1))
    return out


def _check_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuses (ConfigError, at start) the KV caches whose blocks are not each a whole block of
    causal KV of its tokens. A sliding-window, chunked-local or R-SWA manager (a model whose
    every layer is windowed, with HMA off) puts vLLM's shared null block in a request's table for
    tokens out of the window: a hit's load into it fails, and vLLM then recomputes the prompt
    with those tokens' KV written into the null block, which gave other tokens (seen with an
    all-sliding-window Mistral, docs/vllm.md). Non-causal layers (prefix LM) give a block KV of
    later tokens too. Only plain full attention in one group (what a model whose window layers
    are promoted to full attention gets too)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    if kv_cache_config is None:
        return
    groups = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    specs = [
        spec
        for group in groups
        for spec in (group.kv_cache_specs.values() if isinstance(group, UniformTypeKVCacheSpecs) else [group])
    ]
    plain = all(type(spec) is FullAttentionSpec and not spec.non_causal for spec in specs)
    kinds = sorted(
        {
            type(spec).__name__ + (" (non-causal)" if getattr(spec, "non_causal", False) else "")
            for spec in specs
        }
    )
    if len(groups) != 1 or not plain:
        raise ConfigError(
            f"vLLM's KV cache has {len(groups)} group(s) of {kinds}; kvtier's connector stores "
            "causal full-attention KV in one group only (a model whose every layer has a sliding "
            "window, or chunked or non-causal attention, is not supported: docs/vllm.md, Keys)"
        )


class KvtierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self._settings = ConnectorSettings.from_extra_config(ktc.kv_connector_extra_config)
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        _check_kv_cache_groups(kv_cache_config)
        check_parallelism(
            pc.pipeline_parallel_size,
            getattr(pc, "decode_context_parallel_size", 1),
            getattr(pc, "prefill_context_parallel_size", 1),
        )
        self._block_size = int(cc.block_size)
        dtype = str(mc.dtype) if cc.cache_dtype == "auto" else str(cc.cache_dtype)
        self._geometry = geometry_for(
            mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype, self._block_size
        )
        hf = getattr(mc, "hf_config", None)
        rope = {k: v for k in ("rope_scaling", "rope_theta") if (v := getattr(hf, k, None)) is not None}
        computed = str(mc.dtype).removeprefix("torch.")
        computed_in = None if DTYPES.get(computed) == self._geometry.dtype else computed
        variant = model_variant(mc.quantization, rope, getattr(mc, "hf_overrides", None), computed_in)
        self._model = (str(mc.model), mc.revision, variant)
        self._tp_size = int(pc.tensor_parallel_size)
        role_name = ktc.kv_role or "kv_both"
        self._load_enabled = role_name in ("kv_both", "kv_consumer")
        self._save_enabled = role_name in ("kv_both", "kv_producer")
        self._engine_id = str(ktc.engine_id)
        # Every store field is checked now, so a bad one stops vLLM at start, naming the key.
        self._settings.store_config(self._geometry, *self._model, self._tp_size, "check", 0)
        if role == KVConnectorRole.SCHEDULER:
            # A block kvtier cannot give is a cache miss: vLLM recomputes it (unless told to fail).
            ktc.kv_load_failure_policy = self._settings.load_failure_policy
            self._clients = [
                LookupClient(self._engine_id, r, self._settings.lookup_timeout_s)
                for r in range(self._tp_size)
            ]
            self._reqs: dict[str, _Req] = {}
            self._hits: dict[str, int] = {}
            self._async_loads: list[LoadSpec] = []  # planned at allocation, sent with the next meta
            self._late_saves: list[SaveSpec] = []  # of requests that finished in a loading step
        else:
            self._worker: WorkerSide | None = None
            self._server: LookupServer | None = None
            self._layers: dict[str, int] = {}
            self._layerwise = True  # until register_kv_caches sees where the KV cache lives
            self._stats_seen: dict[str, float] = {}  # counters when the stats file was written
            self._reported: dict[str, float] = {}  # counters when vLLM last took our stats
            self._late_finished: set[str] = set()  # finished requests with late saves, until done

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._load_enabled or not self._cacheable(request) or self._skips_cache(request):
            return 0, False
        bs = self._block_size
        max_blocks = (request.num_tokens - 1) // bs  # vLLM always computes the last token
        if max_blocks * bs <= num_computed_tokens:
            return 0, False
        tokens = np.asarray(request.all_token_ids[: max_blocks * bs], dtype=np.uint32)
        extra = self._extra(request)
        hit = min(c.lookup(tokens, extra) for c in self._clients)
        self._hits[request.request_id] = hit
        n = max(0, hit * bs - num_computed_tokens)
        return n, self._settings.load_async and n > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(request, self._extra(request))
        st.block_ids = list(blocks.get_block_ids()[0])
        hit = self._hits.pop(rid, 0)
        st.saved = max(st.saved, hit)
        if num_external_tokens > 0:
            n = num_external_tokens // self._block_size
            if n * self._block_size != num_external_tokens or n > hit:
                raise RuntimeError(
                    f"vLLM asked to load {num_external_tokens} tokens; kvtier offered {hit} blocks"
                )
            if self._settings.load_async:
                # The request waits outside the forward until the worker reports the load done
                # (get_finished): its blocks are known now, so the load is planned now.
                start = hit - n
                ids = st.block_ids[start : start + n]
                tokens = _tokens(st.request.all_token_ids, hit * self._block_size)
                self._async_loads.append(LoadSpec(rid, tokens, st.extra, start, ids))
            else:
                st.load = (hit - n, n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(preempted=bool(scheduler_output.preempted_req_ids))
        meta.async_loads, self._async_loads = self._async_loads, []
        meta.saves, self._late_saves = self._late_saves, []
        meta.late_finished = {s.req_id for s in meta.saves}
        scheduled = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                st.block_ids = list(nr.block_ids[0])
                self._plan(st, nr.num_computed_tokens, scheduled[nr.req_id], meta)
        cr = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                st.block_ids = list(new[0]) if new is not None else []
            elif new is not None:
                st.block_ids.extend(new[0])
            self._plan(st, cr.num_computed_tokens[i], scheduled[rid], meta)
        return meta

    def _plan(self, st: _Req, computed: int, scheduled: int, meta: KvtierConnectorMetadata) -> None:
        bs = self._block_size
        rid = st.request.request_id
        # vLLM rolled back (a failed load, sync or async, a preemption): blocks past `computed` are
        # computed anew, so they are saved again (a put of a present block is a no-op).
        st.saved = min(st.saved, computed // bs)
        loading = st.load is not None
        if st.load is not None:
            start, n = st.load
            st.load = None
            ids = st.block_ids[start : start + n]
            tokens = _tokens(st.request.all_token_ids, (start + n) * bs)
            meta.loads.append(LoadSpec(rid, tokens, st.extra, start, ids))
        st.computed = computed + scheduled
        # With TP > 1 a load can fail on one rank only, and only that rank's worker knows to drop
        # the step's saves: the other ranks' KV of this step's new blocks was computed from the
        # all-reduced hidden states of the missing block. So the saves of a request's loading step
        # wait for its next step (or its finish), when vLLM has applied every rank's load errors
        # (a rollback lowers `computed`, and so the saves).
        st.deferred = loading and self._tp_size > 1
        if not st.deferred:
            self._plan_saves(st, meta.saves)

    def _plan_saves(self, st: _Req, out: list[SaveSpec]) -> None:
        bs = self._block_size
        tokens = st.request.all_token_ids
        if self._save_enabled and self._cacheable(st.request):
            full = min(st.computed, len(tokens), len(st.block_ids) * bs) // bs
            if full > st.saved:
                ids = st.block_ids[st.saved : full]
                out.append(
                    SaveSpec(st.request.request_id, _tokens(tokens, full * bs), st.extra, st.saved, ids)
                )
                st.saved = full
                st.saves_issued = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of a request with saves are freed only once the worker reports them done."""
        self._hits.pop(request.request_id, None)
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.deferred and request.status.name in _FINISHED_WITH_OUTPUT:
            # Finished in its loading step: vLLM accepted that step's output, so no rank failed
            # its load; save the step's blocks now (vLLM keeps them until the workers are done).
            self._plan_saves(st, self._late_saves)
        return (st is not None and st.saves_issued), None

    def reset_cache(self) -> bool | None:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (after a weight update: stored KV is
        of the old weights, and no key can tell): every rank's worker clears its store (its
        namespace on every tier, shared ones included). False if any rank could not; vLLM then
        reports the reset as failed. Requests known here re-save from their next step."""
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        cleared = [c.clear() for c in self._clients]  # every rank, even after one failed
        self._hits.clear()
        for st in self._reqs.values():
            st.saved = 0
        return all(cleared)

    @staticmethod
    def _skips_cache(request: Request) -> bool:
        """A request whose output needs its whole prompt computed (prompt logprobs, some pooling
        tasks): vLLM drops any hit it is offered (`skip_reading_prefix_cache`), so a lookup would
        only wait for the queued saves for nothing."""
        return bool(getattr(request, "skip_reading_prefix_cache", False))

    @staticmethod
    def _cacheable(request: Request) -> bool:
        """Keys cover token ids only: images (equal placeholder tokens) and prompt embeddings (zero
        token ids) would collide across requests, so such requests neither load nor save."""
        return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None

    @staticmethod
    def _extra(request: Request) -> bytes:
        lora = request.lora_request
        if lora is None:
            return request_extra(request.cache_salt, None)
        return request_extra(request.cache_salt, lora.lora_name, lora.lora_path)

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        names = sorted(kv_caches, key=_layer_index)
        num_blocks = int(self._kv_cache_config.num_blocks)
        layers = [_segments(kv_caches[n], num_blocks) for n in names]
        first = kv_caches[names[0]]
        layout = layout_tag(first.device.type, str(first.dtype), tuple(first.shape), len(layers[0]))
        try:
            rank = int(get_tensor_model_parallel_rank())
        except Exception:  # parallel state not initialised (single process)
            rank = 0
        config = self._settings.store_config(self._geometry, *self._model, self._tp_size, layout, rank)
        if self._tp_size > 1 and config.ssd is not None:
            Path(config.ssd.directory).mkdir(mode=0o700, exist_ok=True)  # this rank's pool
        paged = PagedKV(layers, layout)
        stats_file = per_rank_path(self._settings.stats_file, rank, self._tp_size)
        self._worker = WorkerSide(Store(config), paged, stats_file)
        self._layers = {n: i for i, n in enumerate(names)}
        self._layerwise = self._settings.resolve_layerwise(first.device.type)
        self._server = LookupServer(self._engine_id, rank, self._worker)
        log.info(
            "kvtier connector: %d layers, %d blocks of %d bytes, layout %s, rank %d",
            len(names),
            num_blocks,
            paged.block_bytes,
            layout,
            rank,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and meta.async_loads:
            self._worker.start_async_loads(meta.async_loads)
        if self._worker is not None and meta.loads:
            self._worker.start_loads(meta.loads, self._layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            # A name the connector did not register (never expected) waits for every layer:
            # attention must not read a block before its load is done.
            self._worker.wait_layer(self._layers.get(layer_name))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves are whole blocks of every layer, queued after the step (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        self._worker.submit_saves(meta.saves)
        self._late_finished |= meta.late_finished

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done = self._worker.finished(finished_req_ids | self._late_finished)
        self._late_finished -= done
        # Before get_block_ids_with_load_errors in the same pass: a finished async load's failed
        # blocks move to the load errors here, so vLLM sees them no later than the finish.
        loaded = self._worker.finished_async_loads()
        # Called every step, also while vLLM waits for delayed saves: the file stays current.
        counters = self._worker.counter_snapshot()
        if counters != self._stats_seen:
            self._stats_seen = counters
            self._worker.write_stats()
        return (done or None), (loaded or None)

    # ================================================================ metrics (vLLM's own path)
    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        """This worker's counter growth since vLLM last asked (after every step); vLLM sums it over
        workers and steps and feeds `KvtierPromMetrics` in its front end (prom.py)."""
        if self._role == KVConnectorRole.SCHEDULER or self._worker is None:
            return None
        now = self._worker.counter_snapshot()
        grown = delta(now, self._reported)
        self._reported = now
        return KvtierConnectorStats(data=grown) if grown else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.take_load_errors()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Called every step; only a preemption frees blocks whose saves may still be queued (a
        # finished request's blocks wait for get_finished), so only then wait for the saves.
        if self._worker is not None and getattr(kv_connector_metadata, "preempted", False):
            self._worker.drain()

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            for c in self._clients:
                c.close()
            return
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._worker is not None:
            self._worker.close()
