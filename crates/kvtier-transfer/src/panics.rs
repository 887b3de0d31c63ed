//! Worker panics, contained. A transfer worker runs each chunk (pipeline stages), each store-side
//! job step (store jobs, paged jobs) and each duplex transfer under `catch_unwind`: a panic there
//! (a bug in kvtier or the store, an allocation failure) settles the chunk's pending blocks as
//! [`BlockOutcome::Panicked`](crate::BlockOutcome), frees what the chunk held, and the job
//! finishes as usual, so `wait`, `wait_layer` and the engine's drop return instead of hanging
//! (docs/transfer.md §1, "Worker panics"). The worker thread goes on with the next chunk.
//!
//! The cost on the hot path is one `catch_unwind` per chunk (per job for a paged load, per
//! transfer for the duplex engine), never per block: no allocation, a landing pad.
//!
//! With the `test-hooks` feature, [`Faults`] injects panics at named sites
//! (`TransferEngine::panic_for_test`); without it, it is empty and every [`Faults::hit`]
//! compiles to nothing.

use std::any::Any;
#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a test can make a transfer worker panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PanicSite {
    /// A read worker, before a chunk's store read.
    Read,
    /// A decompress worker, before decoding a chunk (reached only for encoded blocks).
    Decompress,
    /// A dequantize worker, before a chunk (reached only for `quant` blocks).
    Dequantize,
    /// A scatter worker, after a chunk's layer 0 is in place and before its other layers.
    Scatter,
    /// A store worker running a paged load, inside the store call, after each layer it
    /// announces (so after layer 0 is in place, before the others).
    PagedLoad,
    /// A store worker, before a store job's chunk (LayerFirst or paged) goes to the store.
    Store,
    /// A duplex swap worker, before a transfer's copies.
    Swap,
}

#[cfg(feature = "test-hooks")]
impl PanicSite {
    pub const ALL: [PanicSite; 7] = [
        PanicSite::Read,
        PanicSite::Decompress,
        PanicSite::Dequantize,
        PanicSite::Scatter,
        PanicSite::PagedLoad,
        PanicSite::Store,
        PanicSite::Swap,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PanicSite::Read => "read",
            PanicSite::Decompress => "decompress",
            PanicSite::Dequantize => "dequantize",
            PanicSite::Scatter => "scatter",
            PanicSite::PagedLoad => "paged_load",
            PanicSite::Store => "store",
            PanicSite::Swap => "swap",
        }
    }

    /// The site named `name` ([`PanicSite::name`]).
    pub fn from_name(name: &str) -> Option<PanicSite> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Panics armed per site (`test-hooks`), per engine; zero-sized without the feature.
#[derive(Default)]
pub(crate) struct Faults {
    /// Per site: 0 = off, n = panic at the n-th pass from now.
    #[cfg(feature = "test-hooks")]
    countdown: [AtomicU64; PanicSite::ALL.len()],
}

impl Faults {
    /// Makes the `nth` (from 1) pass through `site` from now panic; 0 disarms it.
    #[cfg(feature = "test-hooks")]
    pub fn arm(&self, site: PanicSite, nth: u64) {
        self.countdown[site as usize].store(nth, Ordering::SeqCst);
    }

    /// A worker passes `site`: panics if that pass was armed.
    #[inline(always)]
    pub fn hit(&self, site: PanicSite) {
        #[cfg(feature = "test-hooks")]
        {
            let c = &self.countdown[site as usize];
            if c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) == Ok(1) {
                panic!("kvtier test hook: injected panic at {}", site.name());
            }
        }
        #[cfg(not(feature = "test-hooks"))]
        let _ = site;
    }
}

/// The message of a caught panic (`panic!` with a literal or a format string), for errors.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    match (payload.downcast_ref::<&'static str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (None, Some(s)) => s.clone(),
        (None, None) => "a panic without a message".to_string(),
    }
}
