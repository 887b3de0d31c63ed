//! Marks the pipeline's hot path, so a test binary's counting allocator can prove it allocates
//! nothing (`tests/no_allocation_on_hot_path.rs`).
//!
//! A stage worker is *on the hot path* while it processes a chunk. Calls into the store (the
//! read stage's `load_range`, a job's lease release) are *foreign*: the store allocates small
//! O(blocks) bookkeeping there, never a data buffer, and the test checks that bound separately.
//! Reading these flags never allocates (const-initialised thread locals without destructors), so
//! a global allocator may call [`in_hot_path`] itself.

use std::cell::Cell;

thread_local! {
    static HOT: Cell<bool> = const { Cell::new(false) };
    static FOREIGN_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// True on a stage worker processing a chunk, outside store calls.
pub fn in_hot_path() -> bool {
    HOT.with(Cell::get) && FOREIGN_DEPTH.with(Cell::get) == 0
}

/// True on a stage worker processing a chunk, inside a store call.
pub fn in_foreign_call() -> bool {
    HOT.with(Cell::get) && FOREIGN_DEPTH.with(Cell::get) > 0
}

/// Marks the current thread as on the hot path until dropped.
pub(crate) struct HotGuard(());

pub(crate) fn enter() -> HotGuard {
    HOT.with(|h| h.set(true));
    HotGuard(())
}

impl Drop for HotGuard {
    fn drop(&mut self) {
        HOT.with(|h| h.set(false));
    }
}

/// Runs `f` (a call into the store) as foreign code.
pub(crate) fn foreign<R>(f: impl FnOnce() -> R) -> R {
    FOREIGN_DEPTH.with(|d| d.set(d.get() + 1));
    struct Exit;
    impl Drop for Exit {
        fn drop(&mut self) {
            FOREIGN_DEPTH.with(|d| d.set(d.get() - 1));
        }
    }
    let _exit = Exit;
    f()
}
