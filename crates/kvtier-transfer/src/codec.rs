//! The pipeline's codec stages (docs/transfer.md §2) are kvtier-codec's one decoder of untrusted
//! payloads, split into stages ([`kvtier_codec::decoder`]): the read stage hands over each
//! block's verified payload as its tier stores it, with the codec id its object records, and
//!
//! - `raw` (0): the block; decompress and dequantize pass it through.
//! - `lossless` (1): decompress ([`decompress_lossless`]) undoes the backend and the byte-plane
//!   shuffle.
//! - `quant` (2): decompress ([`decompress_quant`]) undoes the backend of its three streams into
//!   the next stage buffer; dequantize ([`dequantize`]) turns them, with the params still in the
//!   read buffer, into fp16 values. So the two are separate stages with their own workers.
//!
//! This file only warms a worker's decoder contexts up.

pub(crate) use kvtier_codec::decoder::{decompress_lossless, decompress_quant, dequantize};
use kvtier_codec::lossless::LosslessCodec;
use kvtier_codec::streams::Backend;
use kvtier_codec::Codec;

/// Sets up this thread's decoder contexts (zstd, deflate) by decoding one `block_bytes`
/// payload of each, so a decompress worker allocates them at start rather than on its first
/// chunk. `scratch` is the worker's plane scratch (`block_bytes`).
pub(crate) fn warm_up(block_bytes: usize, scratch: &mut [u8]) {
    // Compressible (zeros), so the backend really runs.
    let block = vec![0u8; block_bytes - block_bytes % 2];
    let mut out = vec![0u8; block.len()];
    for backend in [Backend::Zstd, Backend::Deflate] {
        let Ok(codec) = LosslessCodec::new(backend, backend.default_level()) else { continue };
        let mut payload = vec![0u8; codec.max_encoded_len(block.len())];
        if let Ok(n) = codec.encode(&block, &mut payload) {
            let _ = decompress_lossless(&payload[..n], &mut out, scratch);
        }
    }
}
