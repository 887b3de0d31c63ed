"""SGLang's host KV pool (`HostKVCache`, the L2 tier) as kvtier pages: torch, no SGLang import.

A kvtier object is one SGLang page: exactly the bytes of ``host_pool.get_data_page(index,
flat=True)``, so the zero-copy calls (``batch_get_v1``/``batch_set_v1``, straight between the
store and the pool) and the tensor calls (``get``/``set`` with flat pages) read and write the
same objects. In every supported layout a page is a few contiguous runs of the pool's buffer:

======================  ==================================  ===============================
host pool, layout       ``kv_buffer`` shape                 runs of one page (object order)
======================  ==================================  ===============================
MHA layer_first         (2, layers, tokens, heads, dim)     K of layer 0..L-1, V of 0..L-1
MHA page_first          (2, tokens, layers, heads, dim)     K, V
MHA page_first_direct   (2, pages, layers, page, heads, d)  K, V
MHA page_head           (2, pages, heads, page, layers, d)  K, V
MLA layer_first         (layers, tokens, 1, latent)         layer 0..L-1
MLA page_first          (tokens, layers, 1, latent)         one run
MLA page_first_direct   (pages, layers, page, 1, latent)    one run
======================  ==================================  ===============================

With SGLang's ``tp_lcm_size`` an MHA page_head page is stored as ``split`` head shards instead
(``HostPages.split``): each of its two runs is ``(heads, page, layers, dim)``, so heads ``i * h /
split`` onward are one contiguous part of each, and the pool's blocks are those shards.

The byte order differs between layouts, so the layout (and dtype) is part of the namespace: a
page written under one layout is never read under another. SGLang keeps fp8 KV as uint8 whatever
its format, so a uint8 pool needs the format named (`kv_cache_dtype`), and the namespace holds
it. Each run is a region of a kvtier :class:`~kvtier.layout.PagedPool` (first axis: page id).

A hybrid model's Mamba state pool (``MambaPoolHost``, layouts page_first and page_first_direct,
whose buffers are both slot-major) has pages of one slot (``page_size`` 1): one request's state
snapshot, the runs ``temporal_buffer[slot]``, each ``conv_buffer[i][slot]``, then each
``slot_state_buffers[i][slot]`` (SGLang's ``_iter_page_tensors`` order; a conv-only model's empty
temporal buffer has no bytes). Their dtypes and shapes are in its layout tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.errors import BufferError, ConfigError, LayoutError
from kvtier.geometry import ExtraGroup, Geometry
from kvtier.integrations.sglang.config import FP8_FORMATS
from kvtier.layout import PagedPool

# torch dtypes of SGLang host pools -> (kvtier's name, the fp8 format it is, if any). uint8 holds
# fp8 KV of any format (SGLang's `store_dtype`): its format comes from `kv_cache_dtype`.
DTYPES = {
    torch.bfloat16: ("bf16", None),
    torch.float16: ("fp16", None),
    torch.float32: ("fp32", None),
    torch.float8_e4m3fn: ("fp8_e4m3", "fp8_e4m3"),
    torch.float8_e5m2: ("fp8_e5m2", "fp8_e5m2"),
    torch.uint8: ("", None),
}
# Host pool classes by kind; subclasses with other buffers (K-only, asymmetric, mxfp8) are refused.
KINDS = {"MHATokenToKVPoolHost": "mha", "MLATokenToKVPoolHost": "mla", "MambaPoolHost": "mamba"}
#: Mamba state pool layouts (SGLang allows no other): both keep every buffer slot-major.
MAMBA_LAYOUTS = ("page_first", "page_first_direct")
# (kind, layout) -> (axis of kv_buffer that indexes tokens or pages, whether it counts tokens).
PAGE_AXIS = {
    ("mha", "layer_first"): (2, True),
    ("mha", "page_first"): (1, True),
    ("mha", "page_first_direct"): (1, False),
    ("mha", "page_head"): (1, False),
    ("mla", "layer_first"): (1, True),
    ("mla", "page_first"): (0, True),
    ("mla", "page_first_direct"): (0, False),
}


def _expected_shape(kind: str, layout: str, pool: Any) -> tuple[int, ...]:
    n, size, ps, layers = pool.page_num, pool.size, pool.page_size, pool.layer_num
    if kind == "mha":
        h, d = pool.head_num, pool.head_dim
        return {
            "layer_first": (2, layers, size, h, d),
            "page_first": (2, size, layers, h, d),
            "page_first_direct": (2, n, layers, ps, h, d),
            "page_head": (2, n, h, ps, layers, d),
        }[layout]
    dim = pool.kv_cache_dim
    return {
        "layer_first": (layers, size, 1, dim),
        "page_first": (size, layers, 1, dim),
        "page_first_direct": (n, layers, ps, 1, dim),
    }[layout]


def _dtype(name: str, buffer_dtype: torch.dtype, kv_cache_dtype: str | None) -> tuple[str, str]:
    """(kvtier's dtype, the namespace's name for the bytes) of a pool holding ``buffer_dtype``;
    ConfigError where ``kv_cache_dtype`` (an fp8 format) is missing or names another dtype."""
    kvtier_dtype, fp8 = DTYPES[buffer_dtype]
    torch_name = str(buffer_dtype).removeprefix("torch.")
    if buffer_dtype == torch.uint8:
        if kv_cache_dtype is None:
            raise ConfigError(
                f"{name} holds uint8: SGLang's fp8 KV, in a format the pool does not record (e4m3 "
                "bytes read as e5m2 are other KV); set `kv_cache_dtype` in the "
                f"hicache-storage-backend-extra-config to SGLang's --kv-cache-dtype, one of {sorted(FP8_FORMATS)}"
            )
        return FP8_FORMATS[kv_cache_dtype], kv_cache_dtype
    if kv_cache_dtype is not None and kv_cache_dtype != fp8:
        raise ConfigError(
            f"`kv_cache_dtype` is {kv_cache_dtype!r} but {name} holds {torch_name}; "
            "leave it unset, or name the fp8 format SGLang stores"
        )
    return kvtier_dtype, torch_name


def _geometry(kind: str, pool: Any, dtype: str, page_bytes: int, split: int = 1) -> Geometry:
    """A kvtier geometry whose block is exactly one page (``page_bytes``), or one of its ``split``
    head shards (MHA)."""
    layers, ps = pool.layer_num, pool.page_size
    if kind == "mha":
        geometry = Geometry(layers, pool.head_num // split, pool.head_dim, dtype, ps)
    elif pool.kv_cache_dim % 2 == 0:  # MLA's latent row, split evenly into "K" and "V" halves
        geometry = Geometry(layers, 1, pool.kv_cache_dim // 2, dtype, ps)
    else:  # an odd latent: 1 element each as "K" and "V", the rest as an extra group
        rest = layers * (pool.kv_cache_dim - 2) * pool.dtype.itemsize
        geometry = Geometry(layers, 1, 1, dtype, ps, (ExtraGroup("mla_latent", rest),))
    if geometry.block_bytes != page_bytes:
        raise LayoutError(
            f"kvtier block of {geometry} is {geometry.block_bytes} bytes; a page is {page_bytes}"
        )
    return geometry


def _state_runs(host_pool: Any) -> tuple[list[npt.NDArray[np.uint8]], list[str]]:
    """The slot-major buffers of a Mamba state pool as ``(slots, bytes)`` views, in SGLang's page
    order, with a ``name=dtype[shape]`` description of each (empty buffers have no bytes)."""
    name, slots = type(host_pool).__name__, int(host_pool.size)
    buffers = [("temporal", host_pool.temporal_buffer)]
    buffers += [(f"conv{i}", b) for i, b in enumerate(host_pool.conv_buffer)]
    buffers += [(f"side{i}", b) for i, b in enumerate(host_pool.slot_state_buffers)]
    runs, parts = [], []
    for label, buffer in buffers:
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise BufferError(f"{name}.{label} buffer is not a contiguous host tensor")
        if buffer.ndim < 1 or buffer.shape[0] != slots:
            raise LayoutError(f"{name}.{label} buffer is {tuple(buffer.shape)}; expected {slots} slots first")
        if buffer.numel() == 0:
            continue  # a conv-only model's temporal state: SGLang's page holds no bytes of it
        runs.append(buffer.reshape(slots, -1).view(torch.uint8).numpy())
        parts.append(f"{label}={str(buffer.dtype).removeprefix('torch.')}{list(buffer.shape[1:])}")
    return runs, parts


@dataclass(frozen=True)
class HostPages:
    """Views of one SGLang host pool, page by page (zero copy), and the geometry of a page."""

    pool: PagedPool
    geometry: Geometry
    layout_tag: str
    is_mla: bool
    page_size: int
    num_pages: int
    page_bytes: int
    dtype: torch.dtype
    #: Objects per page: 1, or the head shards of an MHA ``page_head`` page (``tp_lcm_size``).
    #: Then the pool's blocks are the shards (block ``page * split + i``: heads ``i * h / split``
    #: onward of every run), and a page's ``runs`` each split alike.
    split: int = 1
    runs: int = 1

    @property
    def object_bytes(self) -> int:
        """Bytes of one stored object: the page, or one head shard of it."""
        return self.page_bytes // self.split

    @classmethod
    def from_host_pool(cls, host_pool: Any, kv_cache_dtype: str | None = None, split: int = 1) -> HostPages:
        """Refuses (LayoutError) any pool whose page is not one of the layouts in the module docs,
        or that ``split`` > 1 cannot cut into head shards (an MHA ``page_head`` pool whose heads
        divide by it), and (ConfigError) a uint8 pool without its fp8 format ``kv_cache_dtype``."""
        name = type(host_pool).__name__
        kind = KINDS.get(name)
        layout = str(getattr(host_pool, "layout", None))
        if kind == "mamba" and layout in MAMBA_LAYOUTS:
            return cls._from_state_pool(host_pool, layout)
        if kind is None or (kind, layout) not in PAGE_AXIS:
            supported = sorted(f"{c} {lay}" for c, k in KINDS.items() for (k2, lay) in PAGE_AXIS if k == k2)
            supported += [f"MambaPoolHost {lay}" for lay in MAMBA_LAYOUTS]
            raise LayoutError(
                f"kvtier cannot store pages of a {name} with layout {layout!r}; supported: {supported}"
            )
        if getattr(host_pool, "dcp_size", 1) != 1:
            raise LayoutError(
                f"{name} has dcp_size={host_pool.dcp_size}; kvtier stores pages without DCP only"
            )
        buffer = getattr(host_pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor):
            raise LayoutError(f"{name}.kv_buffer is {type(buffer).__name__}; expected the pool's tensor")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise BufferError(
                f"{name}.kv_buffer is on {buffer.device}, contiguous={buffer.is_contiguous()}; expected a contiguous host tensor"
            )
        if buffer.dtype not in DTYPES:
            raise LayoutError(f"{name} holds {buffer.dtype}; kvtier stores {sorted(str(d) for d in DTYPES)}")
        dtype, dtype_tag = _dtype(name, buffer.dtype, kv_cache_dtype)
        expected = _expected_shape(kind, layout, host_pool)
        if tuple(buffer.shape) != expected:
            raise LayoutError(f"{name} ({layout}) kv_buffer is {tuple(buffer.shape)}; expected {expected}")
        axis, counts_tokens = PAGE_AXIS[(kind, layout)]
        num_pages, page_size = int(host_pool.page_num), int(host_pool.page_size)
        if counts_tokens and buffer.shape[axis] != num_pages * page_size:
            raise LayoutError(
                f"{name} has {buffer.shape[axis]} token rows; expected {num_pages} pages x {page_size}"
            )
        if split != 1 and ((kind, layout) != ("mha", "page_head") or host_pool.head_num % split):
            raise LayoutError(
                f"{name} ({kind} {layout}, {getattr(host_pool, 'head_num', 1)} heads) cannot be cut into "
                f"{split} head shards (tp_lcm_size / tp_size); expected an MHA page_head pool whose "
                "heads divide by it"
            )
        raw = buffer.view(torch.uint8).numpy()  # the pool's own memory, as bytes
        runs = int(np.prod(buffer.shape[:axis], dtype=np.int64))
        by_page = raw.reshape(runs, num_pages, -1)
        # page_head: a run of a page is (heads, page, layers, dim), so a shard's part is contiguous.
        pool = PagedPool([[by_page[i].reshape(num_pages * split, -1)] for i in range(runs)])
        page_bytes = pool.block_bytes * split
        if page_bytes != host_pool.get_size_per_token() * page_size:
            raise LayoutError(
                f"{name} pages are {host_pool.get_size_per_token()} x {page_size} bytes; runs hold {page_bytes}"
            )
        return cls(
            pool=pool,
            geometry=_geometry(kind, host_pool, dtype, pool.block_bytes, split),
            layout_tag=f"{kind}-{layout}-{dtype_tag}",
            is_mla=kind == "mla",
            page_size=page_size,
            num_pages=num_pages,
            page_bytes=page_bytes,
            dtype=buffer.dtype,
            split=split,
            runs=runs,
        )

    @classmethod
    def _from_state_pool(cls, host_pool: Any, layout: str) -> HostPages:
        """A Mamba state pool: a page is one slot (module docs). Its geometry only sizes the
        object (2 bytes of "KV" and the rest as an extra group); what the bytes are is in the tag."""
        name = type(host_pool).__name__
        if int(host_pool.page_size) != 1:
            raise LayoutError(f"{name} has page_size={host_pool.page_size}; expected 1 (one state per slot)")
        runs, parts = _state_runs(host_pool)
        if not runs:
            raise LayoutError(f"{name} holds no state bytes")
        pool = PagedPool([[run] for run in runs])
        page_bytes = pool.block_bytes
        if page_bytes != host_pool.get_size_per_token() or page_bytes < 3:
            raise LayoutError(
                f"{name} pages are {host_pool.get_size_per_token()} bytes; its buffers hold {page_bytes}"
            )
        geometry = Geometry(1, 1, 1, "fp8_e4m3", 1, (ExtraGroup("mamba_state", page_bytes - 2),))
        return cls(
            pool=pool,
            geometry=geometry,
            layout_tag=f"mamba-{layout}-{'+'.join(parts)}",
            is_mla=False,
            page_size=1,
            num_pages=int(host_pool.size),
            page_bytes=page_bytes,
            dtype=torch.uint8,
        )

    def page_ids(self, host_indices: Any, count: int) -> npt.NDArray[np.int64]:
        """The pool pages of ``count`` pages of token slots ``host_indices`` (SGLang hands whole,
        aligned pages: ``count * page_size`` slots). LayoutError for anything else."""
        if not isinstance(host_indices, torch.Tensor):
            raise LayoutError(
                f"host_indices is {type(host_indices).__name__}; expected a torch tensor of slots"
            )
        if (
            host_indices.dtype.is_floating_point
            or host_indices.dtype == torch.bool
            or host_indices.is_complex()
        ):
            raise LayoutError(f"host_indices have dtype {host_indices.dtype}; expected integer slots")
        if host_indices.ndim != 1 or host_indices.numel() != count * self.page_size:
            raise LayoutError(
                f"host_indices have shape {tuple(host_indices.shape)}; expected ({count * self.page_size},): "
                f"{count} pages of {self.page_size} slots"
            )
        slots = host_indices.detach().to("cpu", torch.int64).reshape(count, self.page_size)
        first = slots[:, 0]
        if count and (int(first.min()) < 0 or int(first.max()) >= self.num_pages * self.page_size):
            raise LayoutError(f"host_indices reach past the pool's {self.num_pages * self.page_size} slots")
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        if bool((first % self.page_size != 0).any()) or not torch.equal(slots, first[:, None] + offsets):
            raise LayoutError(f"host_indices are not whole, aligned pages of {self.page_size} slots")
        ids: npt.NDArray[np.int64] = (first // self.page_size).numpy()
        if self.split > 1:  # each page's shards, in head order
            ids = (ids[:, None] * self.split + np.arange(self.split, dtype=np.int64)).reshape(-1)
        return ids

    def page_view(self, tensor: Any, what: str) -> npt.NDArray[np.uint8]:
        """A flat page tensor (``get_data_page(i, flat=True)`` or a dummy page) as a ``(1,
        page_bytes)`` uint8 view of its memory; BufferError unless it is exactly one page."""
        if not isinstance(tensor, torch.Tensor):
            raise BufferError(f"{what} is {type(tensor).__name__}; expected a torch tensor of one page")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise BufferError(
                f"{what} is on {tensor.device}, contiguous={tensor.is_contiguous()}; expected a contiguous CPU tensor"
            )
        if tensor.dtype != self.dtype or tensor.numel() * tensor.element_size() != self.page_bytes:
            raise BufferError(
                f"{what} is {tensor.dtype} {tuple(tensor.shape)}; expected one page of {self.dtype}, "
                f"{self.page_bytes} bytes"
            )
        view: npt.NDArray[np.uint8] = tensor.reshape(-1).view(torch.uint8).numpy()
        return view.reshape(1, self.page_bytes)

    def page_objects(self, page: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """A page's bytes (:meth:`page_view`) as its ``(split, object_bytes)`` stored objects: the
        page itself, or its head shards (a copy)."""
        if self.split == 1:
            return page
        shards = page.reshape(self.runs, self.split, -1).transpose(1, 0, 2)
        return np.ascontiguousarray(shards).reshape(self.split, self.object_bytes)

    def fill_page(self, page: npt.NDArray[np.uint8], objects: npt.NDArray[np.uint8]) -> None:
        """Writes a page's ``(split, object_bytes)`` objects into its bytes (:meth:`page_view`)."""
        page.reshape(self.runs, self.split, -1)[...] = objects.reshape(self.split, self.runs, -1).transpose(
            1, 0, 2
        )
