"""``cachegen_async``: ShadowServe's CacheGen-Async baseline (§6.1): CacheGen's compressed KV fetch
with decompression on the GPU, made asynchronous with ShadowServe's own batch interception (§4.1).

"Because the original implementation of CacheGen does not support asynchronous fetching, we enable
it with our design (§4.1). It bypasses the BlueField-3, using it as a normal NIC, and utilizes GPU
for KV cache decompression ... and implements a chunked pipeline of network transmission and
decompression" (§6.1). So the control plane is :class:`~kvtier.sched.shadowserve.BatchInterception`
and only the fetch differs from ``shadowserve_async``:

- compressed bytes cross the network *and* PCIe (``decode_on_device=True``), and the GPU decodes
  them (arithmetic decoding, then dequantization) at :data:`DECODE_INPUT_BYTES_PER_S` of compressed
  input: "the decompression in CacheGen-Async has a maximum throughput of ~32 Gbps under
  interference" (§6.2.2), which also makes it the bottleneck at 40 Gbps;
- while it decodes, model compute on the same GPU slows down (§2.2, Fig. 3: with arithmetic
  decoding "it is not possible to limit both tasks' slowdown below 30% at the same time"; with
  dequantization "more than 25% slowdown for both"). :data:`INTERFERENCE` is that 30% floor. The
  decoder runs only while chunks are there to decode: at a network rate below its own it idles
  between chunks, so the slowdown is scaled by the decoder's duty cycle over the fetch (its busy
  time over the fetch's time). §6.2.2 sees exactly that: CacheGen-Async's loaded TPOT rises with
  bandwidth "from more frequent GPU kernel launches ... as the network stage becomes shorter";
- CacheGen's bitstream is larger than ShadowServe's Deflate output (§6.2.1: "Deflate ... provides a
  better compression ratio than CacheGen-Async's arithmetic coding"). The paper does not give
  CacheGen's ratio; :data:`COMPRESSION_RATIO` is derived from its unloaded TTFTs at 20 Gbps
  (600.5 ms vs 502.2 ms, §6.2.1), where both systems are network bound (ShadowServe's network
  stage tops out at 20.6 Gbps, CacheGen's decoder at ~32 Gbps): the bytes on the wire scale as
  the fetch times, 502.2/600.5 of ShadowServe's ratio.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import LoadMode, RequestView, SchedulerView, register
from kvtier.sched.shadowserve import BLUEFIELD3, GBPS, BatchInterception, store_tier

COMPRESSION_RATIO = BLUEFIELD3.compression_ratio * 502.2 / 600.5
DECODE_INPUT_BYTES_PER_S = 32.0 * GBPS
INTERFERENCE = 0.30


@register
class CacheGenAsync(BatchInterception):
    name = "cachegen_async"
    decode_on_device = True  # the GPU decodes: compressed bytes cross PCIe (§2.2)

    def __init__(
        self,
        fetch_mode: str = "async",
        serial_fetch: bool = True,
        compression_ratio: float = COMPRESSION_RATIO,
        decode_input_bytes_per_s: float = DECODE_INPUT_BYTES_PER_S,
        interference: float = INTERFERENCE,
        duty_cycle: bool = True,
    ) -> None:
        super().__init__(fetch_mode, serial_fetch)
        if compression_ratio < 1 or not decode_input_bytes_per_s > 0 or interference < 0:
            raise ConfigError(
                f"cachegen_async: compression_ratio {compression_ratio} (>= 1), decode_input_bytes_per_s "
                f"{decode_input_bytes_per_s} (> 0), interference {interference} (>= 0)"
            )
        self.compression_ratio = compression_ratio
        self.decode_input_bytes_per_s = decode_input_bytes_per_s
        # The GPU decoder's rate in raw (decoded) KV bytes.
        self.decode_bytes_per_s = decode_input_bytes_per_s * compression_ratio
        self.interference = interference
        self.duty_cycle = duty_cycle

    def decoder_duty(self, view: SchedulerView, r: RequestView, tokens: int) -> float:
        """Fraction of a fetch of ``tokens`` during which the GPU decoder is busy.

        The network time is the view's raw-bytes load estimate over the store link divided by the
        compression ratio (an upper bound when the host link, not the store link, is the slower);
        the decoder time is the raw bytes over its raw rate. Unknown KV size: 1.
        """
        if not self.duty_cycle or view.kv_bytes_per_token <= 0:
            return 1.0
        network_s = view.cost.load_s(tokens, store_tier(r), LoadMode.ASYNC, None) / self.compression_ratio
        decode_s = tokens * view.kv_bytes_per_token / self.decode_bytes_per_s
        return decode_s / max(network_s, decode_s, 1e-12)

    def fetch_interference(self, view: SchedulerView, r: RequestView, tokens: int) -> float:
        return self.interference * self.decoder_duty(view, r, tokens)

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "compression_ratio": self.compression_ratio,
            "decode_input_bytes_per_s": self.decode_input_bytes_per_s,
            "interference": self.interference,
            "duty_cycle": self.duty_cycle,
        }
