//! Pause points for tests: with the `test-hooks` feature, a test installs a hook
//! ([`Store::set_hook_for_test`](crate::Store::set_hook_for_test)) that the store calls at
//! named points of a put, a load and a clear, so a test can hold a call mid-flight (on a channel,
//! not a sleep) and run another against it: a clear against a put that is writing, say. Without
//! the feature [`Hooks`] is empty and every [`Hooks::at`] compiles to nothing.

#[cfg(feature = "test-hooks")]
use std::sync::Arc;

#[cfg(feature = "test-hooks")]
use parking_lot::RwLock;

/// Where the store calls a test's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HookPoint {
    /// A put, or a load's promotion, is about to write its blocks into DRAM.
    DramWrite,
    /// Blocks are about to be written to SSD (write-through, or demotion of DRAM's victims).
    SsdWrite,
    /// Blocks are about to be written to the remote tier (write-through, or write-back of
    /// DRAM's victims).
    RemoteWrite,
    /// A load has read its blocks into the caller's buffers and is about to return.
    LoadRead,
    /// A clear found writes or loads in flight and is about to wait for them.
    ClearWaits,
    /// A lease has located and pinned its blocks and is about to be granted (the lease table's
    /// lock is not held).
    LeaseLocated,
}

/// A test's hook, called with each point the store passes.
#[cfg(feature = "test-hooks")]
pub type Hook = Arc<dyn Fn(HookPoint) + Send + Sync>;

/// The hook a test installed (`test-hooks`); zero-sized without the feature.
#[derive(Default)]
pub(crate) struct Hooks {
    #[cfg(feature = "test-hooks")]
    hook: RwLock<Option<Hook>>,
}

impl Hooks {
    /// Installs `hook` (or, with `None`, removes it).
    #[cfg(feature = "test-hooks")]
    pub fn set(&self, hook: Option<Hook>) {
        *self.hook.write() = hook;
    }

    /// The store passes `point`: calls the hook, if one is installed.
    #[inline(always)]
    pub fn at(&self, point: HookPoint) {
        #[cfg(feature = "test-hooks")]
        {
            let hook = self.hook.read().clone();
            if let Some(hook) = hook {
                hook(point);
            }
        }
        #[cfg(not(feature = "test-hooks"))]
        let _ = point;
    }
}
