"""vLLM's paged KV cache as kvtier block objects (numpy only; no torch, no vLLM).

vLLM gives a connector one tensor per attention layer. On the CPU platform each is
`(num_blocks, kv_heads, block_size, 2 * head_dim)` ("LBHNC": K and V concatenated per token), so
one block of one layer is one contiguous run of bytes; CUDA backends use `(2, num_blocks, ...)`,
one run for K and one for V. Either way a block of a layer is a few contiguous *segments*.

A kvtier object is one block of every layer: the segments of layer 0, then layer 1, ... in
vLLM's own byte order. Saving gathers a block's segments into its object; loading scatters them
back, one layer at a time so attention on layer l can start once layer l is in place. The order
is vLLM's, not kvtier's canonical one, so the layout is part of the namespace (`layout_tag`):
only an engine with the same layout ever reads these objects.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvtier.errors import BufferError, LayoutError

U8 = npt.NDArray[np.uint8]
Ids = npt.NDArray[np.int64]


def layout_tag(device: str, dtype: str, shape: tuple[int, ...], segments: int) -> str:
    """The namespace's name for a layout: device, dtype, the per-layer tensor's shape without its
    block axis (axis 0 with one segment per layer, axis 1 with two: `(2, num_blocks, ...)`),
    and the segments per layer. Only the block axis leaves the shape: a dimension that happens
    to equal the block count stays, so two byte orders never share a tag."""
    block_axis = 0 if segments == 1 else 1
    rest = "x".join(str(d) for i, d in enumerate(shape) if i != block_axis)
    return f"{device}:{dtype}:{rest}:{segments}seg"


class PagedKV:
    """Views of vLLM's per-layer KV arrays, each `(num_blocks, segment_bytes)` uint8 (zero copy)."""

    def __init__(self, layers: list[list[U8]], layout_tag: str) -> None:
        if not layers or any(not segs for segs in layers):
            raise LayoutError("a paged KV cache needs at least one layer with at least one segment")
        self.num_blocks = int(layers[0][0].shape[0])
        for i, segs in enumerate(layers):
            for j, seg in enumerate(segs):
                if seg.dtype != np.uint8 or seg.ndim != 2 or not seg.flags.c_contiguous:
                    raise BufferError(
                        f"layer {i} segment {j} is {seg.dtype} {seg.shape}; expected a C-contiguous "
                        "(num_blocks, bytes) uint8 view"
                    )
                if seg.shape[0] != self.num_blocks:
                    raise LayoutError(
                        f"layer {i} segment {j} has {seg.shape[0]} blocks; layer 0 has {self.num_blocks}"
                    )
                if not seg.flags.writeable:
                    raise BufferError(f"layer {i} segment {j} is read-only; loads write into it")
        self.layers = layers
        self.layout_tag = layout_tag
        # Byte offset of each (layer, segment) inside an object.
        self.offsets: list[list[tuple[int, int]]] = []
        off = 0
        for segs in layers:
            row = []
            for seg in segs:
                row.append((off, off + seg.shape[1]))
                off += seg.shape[1]
            self.offsets.append(row)
        self.block_bytes = off

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_ids(self, block_ids: npt.ArrayLike) -> Ids:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise LayoutError(f"block ids {ids.tolist()} out of range for {self.num_blocks} blocks")
        return ids

    def gather(self, block_ids: npt.ArrayLike, out: U8 | None = None) -> U8:
        """Blocks `block_ids` as objects `(n, block_bytes)`."""
        ids = self.check_ids(block_ids)
        if out is None:
            out = np.empty((ids.size, self.block_bytes), dtype=np.uint8)
        if out.shape != (ids.size, self.block_bytes) or out.dtype != np.uint8:
            raise BufferError(
                f"out is {out.dtype} {out.shape}; expected uint8 {(ids.size, self.block_bytes)}"
            )
        for segs, offs in zip(self.layers, self.offsets, strict=True):
            for seg, (a, b) in zip(segs, offs, strict=True):
                np.take(seg, ids, axis=0, out=out[:, a:b], mode="clip")
        return out

    def scatter_layer(self, layer: int, block_ids: Ids, objects: U8) -> None:
        """Layer `layer` of `objects[i]` into block `block_ids[i]` (ids checked by the caller)."""
        for seg, (a, b) in zip(self.layers[layer], self.offsets[layer], strict=True):
            seg[block_ids] = objects[:, a:b]

    def scatter(self, block_ids: npt.ArrayLike, objects: U8) -> None:
        ids = self.check_ids(block_ids)
        if objects.shape != (ids.size, self.block_bytes):
            raise BufferError(f"objects are {objects.shape}; expected {(ids.size, self.block_bytes)}")
        for layer in range(self.num_layers):
            self.scatter_layer(layer, ids, objects)
