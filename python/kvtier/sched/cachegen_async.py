"""``cachegen_async``: ShadowServe's CacheGen-Async baseline (§6.1): CacheGen's compressed KV fetch
with decompression on the GPU, made asynchronous with ShadowServe's own batch interception (§4.1).

"Because the original implementation of CacheGen does not support asynchronous fetching, we enable
it with our design (§4.1). It bypasses the BlueField-3, using it as a normal NIC, and utilizes GPU
for KV cache decompression ... and implements a chunked pipeline of network transmission and
decompression" (§6.1). So the control plane is :class:`~kvtier.sched.shadowserve.BatchInterception`
and only the fetch differs from ``shadowserve_async``, in the data plane: compressed bytes cross the
network *and* PCIe and the GPU decodes them, slowing model compute by its duty cycle (the sim
config's ``fetch: {engine: cachegen_gpu}``, :data:`~kvtier.sched.fetch_path.FETCH_ENGINES`, this
policy's default). The decisions are ShadowServe's: the comparison of §6.2 is a data-plane
difference, ``shadowserve_async`` with ``fetch: {engine: cachegen_gpu}`` decides the same.
"""

from __future__ import annotations

from kvtier.sched.base import register
from kvtier.sched.shadowserve import ShadowServeAsync


@register
class CacheGenAsync(ShadowServeAsync):
    """ShadowServe's batch interception; the GPU-decoder fetch path is the data plane's."""

    name = "cachegen_async"
