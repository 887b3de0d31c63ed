//! Codec ids and names, and the buffer checks every codec shares: the bottom of the crate, so
//! the codecs and the decoder import it downward.

use crate::error::CodecError;

/// Codec ids, as recorded in the object header's `codec id` field.
pub const CODEC_RAW: u16 = 0;
pub const CODEC_LOSSLESS: u16 = 1;
pub const CODEC_QUANT: u16 = 2;

/// Names of the known codecs, indexed by id.
pub const CODEC_NAMES: [&str; 3] = ["raw", "lossless", "quant"];

/// The id of the codec called `name`, or `None`.
pub fn codec_id(name: &str) -> Option<u16> {
    CODEC_NAMES.iter().position(|n| *n == name).map(|i| i as u16)
}

/// Checks that `out` can hold `needed` bytes.
pub(crate) fn check_out(needed: u64, out: &[u8]) -> Result<usize, CodecError> {
    if (out.len() as u64) < needed {
        return Err(CodecError::OutputTooSmall { needed, have: out.len() as u64 });
    }
    Ok(needed as usize)
}

/// A thread's reusable scratch buffer (decoders run on many threads at once).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0);
        }
        f(&mut s[..len])
    })
}
