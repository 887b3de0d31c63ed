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

/// Largest scratch buffer a thread keeps between calls (a few blocks of the largest models).
const SCRATCH_KEPT_MAX: usize = 64 << 20;

/// A thread's reusable scratch buffer (decoders run on many threads at once). A longer one is
/// allocated for the call and freed after it: a payload may declare up to `DECODED_LEN_MAX`, and
/// one such payload must not pin that much memory in the thread for its life. Grown buffers are
/// fresh zeroed allocations (pages the OS maps on first write), never zero-filled here: a corrupt
/// payload is refused before anything is written, so its declared length costs no memory.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if len > SCRATCH_KEPT_MAX {
        return f(&mut vec![0u8; len]);
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            *s = vec![0u8; len];
        }
        f(&mut s[..len])
    })
}
