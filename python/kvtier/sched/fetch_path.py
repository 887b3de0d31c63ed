"""How a compressed fetch moves cached KV from the store to the device: data-plane configuration, not
policy (issue 18 step 4).

:class:`FetchPath` describes the path a *compressed* load takes (a :class:`~kvtier.sched.base.
LoadOrder` with ``compressed=True``: ShadowServe's and CacheGen-Async's fetches, composed's
``async_fetch`` stage); :data:`FETCH_ENGINES` names the paths the reproductions use. The simulator's
config chooses one (``fetch: {engine: bluefield3}``, :func:`fetch_path`, with per-key overrides);
where it names none, the path the policy's paper ran on (:mod:`kvtier.sched.data_plane`). A policy
decides *which* loads go compressed and reads the engine's path from its view
(``SchedulerView.fetch``) to weigh them; the engine moves the bytes and, while a fetch runs, slows
its model compute by :meth:`FetchPath.fetch_interference` (worked out when it starts the fetch).

**ShadowServe's SmartNIC (§4.2-§4.3, §6.3).** A fetch crosses network -> lossless decompression
(Deflate, on the BlueField-3 accelerator) -> dequantization (Arm cores) -> DMA into GPU memory, chunk
by chunk (256 tokens, §5), so the four stages overlap and the slowest sets the rate. The engine
models a compressed fetch as concurrent stages: the store link carries ``raw / compression_ratio``
bytes, a decoder stage runs at the decoder's rate (raw bytes), and the host link carries raw bytes
(``decode_on_device=False``: the SmartNIC DMAs decoded KV over PCIe). :class:`ChunkedPipeline` gives
the decoder stage the SmartNIC's throughput: the slowest of its four stages *while they run together*
(Fig. 13b), in raw KV bytes. That is the network stage, which the SoC's memory system holds to 20.6
Gbps (§6.3): so above ~20 Gbps of link bandwidth ShadowServe stops getting faster (§6.2.2, Fig.
11b). The per-round scatter kernel's slowdown is ``interference`` (0: "this memory copy kernel
causes negligible overhead", §4.3).

**CacheGen-Async's GPU decoder (ShadowServe §6.1, §2.2).** It "bypasses the BlueField-3, using it as
a normal NIC, and utilizes GPU for KV cache decompression": compressed bytes cross the network *and*
PCIe (``decode_on_device=True``), and the GPU decodes them at :data:`DECODE_INPUT_BYTES_PER_S` of
compressed input ("a maximum throughput of ~32 Gbps under interference", §6.2.2). While it decodes,
model compute on the same GPU slows down (§2.2, Fig. 3: "not possible to limit both tasks' slowdown
below 30% at the same time"); :data:`INTERFERENCE` is that 30% floor, scaled by the decoder's duty
cycle over the fetch (``duty_cycle``: at a network rate below its own it idles between chunks;
§6.2.2's TPOT rises with bandwidth). CacheGen's bitstream is larger than ShadowServe's Deflate
output (§6.2.1); :data:`COMPRESSION_RATIO` is derived from the unloaded TTFTs at 20 Gbps (600.5 ms vs
502.2 ms, §6.2.1), where both systems are network bound: 502.2/600.5 of ShadowServe's ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.section import profile, profile_section

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class ChunkedPipeline:
    """ShadowServe's SmartNIC data plane: four pipelined stages, each with its measured throughput
    while all run together (§6.3, Fig. 13b), and the compression the stored KV went through.

    Throughputs are bytes per second of each stage's *output* unless named otherwise. The pipeline's
    rate is its slowest stage's, expressed in raw (decoded) KV bytes so that stages with different
    input and output sizes compare.
    """

    # Network (XLIO TCP on 2 Arm cores): 37.3 Gbps standalone, 20.6 Gbps with the other stages
    # running (§6.3, Fig. 13b: inter-stage memory contention on the SoC). Compressed bytes.
    network_bytes_per_s: float = 20.6 * GBPS
    # Deflate on the BlueField-3 accelerator: ~280 Gbps output standalone (§6.3; 276.5 in Table 1),
    # 27% less in the pipeline (§6.3). Output is quantized bytes.
    decompress_out_bytes_per_s: float = 280.0 * (1 - 0.27) * GBPS
    # Dequantization on 14 Arm cores with Neon: 83.5 Gbps in, 167 Gbps out, unchanged in the
    # pipeline (§6.3). Output is raw KV.
    dequantize_out_bytes_per_s: float = 167.0 * GBPS
    # DMA engine into GPU memory: 230 Gbps standalone, 24% less in the pipeline (§6.3). Raw KV.
    copy_bytes_per_s: float = 230.0 * (1 - 0.24) * GBPS
    # Vector-wise quantization "exactly halves the original data size" (§4.3).
    quantization_ratio: float = 2.0
    # Deflate on the quantized KV: §6.3 picks "a chunk size of 6 MB (256 tokens)" at the network
    # stage, i.e. 6 MiB on the wire for 256 Llama-8B tokens that are 32 MiB raw (128 KiB/token in
    # bf16): 32/6 overall, so Deflate adds 32/6/2 = 2.67x. (That the 6 MB is the compressed chunk is
    # our reading: it is the network stage's input chunk that Fig. 13a sweeps.)
    deflate_ratio: float = 32.0 / 6.0 / 2.0

    def __post_init__(self) -> None:
        for name in (
            "network_bytes_per_s",
            "decompress_out_bytes_per_s",
            "dequantize_out_bytes_per_s",
            "copy_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"chunked pipeline `{name}` is {getattr(self, name)}; expected > 0")
        if self.quantization_ratio < 1 or self.deflate_ratio < 1:
            raise ConfigError("chunked pipeline compression ratios must be >= 1")

    @property
    def compression_ratio(self) -> float:
        """Raw KV bytes per byte on the wire."""
        return self.quantization_ratio * self.deflate_ratio

    def stage_raw_bytes_per_s(self) -> dict[str, float]:
        """Each stage's throughput in raw KV bytes per second."""
        return {
            "network": self.network_bytes_per_s * self.compression_ratio,
            "decompress": self.decompress_out_bytes_per_s * self.quantization_ratio,
            "dequantize": self.dequantize_out_bytes_per_s,
            "copy": self.copy_bytes_per_s,
        }

    def raw_bytes_per_s(self) -> float:
        """The pipeline's rate (its slowest stage), in raw KV bytes per second."""
        return min(self.stage_raw_bytes_per_s().values())

    def bottleneck(self) -> str:
        stages = self.stage_raw_bytes_per_s()
        return min(stages, key=stages.__getitem__)


BLUEFIELD3 = ChunkedPipeline()
# CacheGen-Async (ShadowServe §6.1): its bitstream's ratio, its GPU decoder's input rate and slowdown.
COMPRESSION_RATIO = BLUEFIELD3.compression_ratio * 502.2 / 600.5
DECODE_INPUT_BYTES_PER_S = 32.0 * GBPS
INTERFERENCE = 0.30


@dataclass(frozen=True, slots=True)
class FetchPath:
    """How a compressed load crosses from the store (SSD, remote) to the device.

    The defaults are the engine's plain path: nothing compressed, no decoder stage, no slowdown.
    The decoder's rate is ``decode_bytes_per_s`` in raw (decoded) KV bytes, or
    ``decode_input_bytes_per_s`` in compressed input bytes (at most one; neither: no decoder stage).
    """

    compression_ratio: float = 1.0  # raw KV bytes per byte on the store link
    decode_bytes_per_s: float | None = None
    decode_input_bytes_per_s: float | None = None
    decode_on_device: bool = False  # compressed bytes cross the host link and decode on the GPU
    interference: float = 0.0  # fractional slowdown of model compute while a fetch runs
    duty_cycle: bool = False  # scale ``interference`` by the decoder's busy fraction of the fetch

    def __post_init__(self) -> None:
        if not self.compression_ratio >= 1:
            raise ConfigError(f"fetch `compression_ratio` is {self.compression_ratio}; expected >= 1")
        if self.decode_bytes_per_s is not None and self.decode_input_bytes_per_s is not None:
            raise ConfigError("fetch: give `decode_bytes_per_s` or `decode_input_bytes_per_s`, not both")
        for name in ("decode_bytes_per_s", "decode_input_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"fetch `{name}` is {value}; expected > 0")
        if not self.interference >= 0:
            raise ConfigError(f"fetch `interference` is {self.interference}; expected >= 0")
        for name in ("decode_on_device", "duty_cycle"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"fetch `{name}` is {getattr(self, name)!r}; expected true or false")

    def decoder_bytes_per_s(self) -> float | None:
        """The decoder stage's rate in raw KV bytes per second; None: no decoder stage."""
        if self.decode_input_bytes_per_s is not None:
            return self.decode_input_bytes_per_s * self.compression_ratio
        return self.decode_bytes_per_s

    def decoder_duty(self, kv_bytes_per_token: int, tokens: int, store_load_s: Callable[[], float]) -> float:
        """Fraction of a fetch of ``tokens`` during which the decoder is busy.

        The network time is ``store_load_s()`` (the raw-bytes load estimate over the store link)
        divided by the compression ratio (an upper bound when the host link, not the store link, is
        the slower); the decoder time is the raw bytes over its raw rate. Unknown KV size or no
        decoder: 1.
        """
        rate = self.decoder_bytes_per_s()
        if not self.duty_cycle or kv_bytes_per_token <= 0 or rate is None:
            return 1.0
        network_s = store_load_s() / self.compression_ratio
        decode_s = tokens * kv_bytes_per_token / rate
        return decode_s / max(network_s, decode_s, 1e-12)

    def fetch_interference(
        self, kv_bytes_per_token: int, tokens: int, store_load_s: Callable[[], float]
    ) -> float:
        """How much a compressed fetch of ``tokens`` slows the model's compute while it runs."""
        if not self.duty_cycle:
            return self.interference
        return self.interference * self.decoder_duty(kv_bytes_per_token, tokens, store_load_s)


#: The engine's plain path (the defaults).
PLAIN_FETCH = FetchPath()

FETCH_ENGINES: dict[str, FetchPath] = {
    "plain": PLAIN_FETCH,
    # ShadowServe's BlueField-3 chunked pipeline (§4.2-§4.3): decoded on the SmartNIC, raw KV DMAed.
    "bluefield3": FetchPath(
        compression_ratio=BLUEFIELD3.compression_ratio, decode_bytes_per_s=BLUEFIELD3.raw_bytes_per_s()
    ),
    # CacheGen-Async (ShadowServe §6.1): the NIC as a plain NIC, decoded on the GPU, duty-cycled slowdown.
    "cachegen_gpu": FetchPath(
        compression_ratio=COMPRESSION_RATIO,
        decode_input_bytes_per_s=DECODE_INPUT_BYTES_PER_S,
        decode_on_device=True,
        interference=INTERFERENCE,
        duty_cycle=True,
    ),
}
#: The keys of a ``fetch`` section besides ``engine``: :class:`FetchPath`'s fields.
FETCH_KEYS = tuple(f.name for f in fields(FetchPath))


def fetch_engine(name: str) -> FetchPath:
    """The :class:`FetchPath` named ``name`` in :data:`FETCH_ENGINES`; unknown names raise."""
    return profile("fetch", FETCH_ENGINES, name)


def _one_decoder_rate(changes: dict[str, Any]) -> None:
    """A decoder rate given one way replaces the engine's, given the other."""
    rates = ("decode_bytes_per_s", "decode_input_bytes_per_s")
    for given, other in (rates, rates[::-1]):
        if given in changes and other not in changes:
            changes[other] = None


def fetch_path(section: Mapping[str, Any] | None, default: str) -> FetchPath:
    """The sim config's ``fetch`` section as a :class:`FetchPath`: ``{engine: NAME, KEY: VALUE...}``,
    the named path with the given keys (:data:`FETCH_KEYS`) changed; ``None`` or no ``engine``: the
    path named ``default``. A decoder rate given one way replaces the engine's, given the other."""
    return profile_section(
        "fetch", section, FETCH_ENGINES, FETCH_KEYS, default, "{engine: bluefield3}", _one_decoder_rate
    )
