//! Jobs submitted before a `Store::clear` and run after it move no KV of before the clear: a store
//! job stores nothing (its blocks are `StoreFailed`: its KV was computed before the clear), and a
//! load job, whose lease the clear emptied, loads nothing (`ReadFailed`). The job is held on its
//! worker, outside the store, by a store handle that blocks the worker's first call (a channel,
//! not a sleep) while the test clears the store.

use crate::common;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use common::{engine, geometry, keys, new_pool, put_raw, store};
use kvtier_store::Store;
use kvtier_transfer::{BlockOutcome, StoreHandle, TransferConfig, TransferEngine};

/// The store, lent to the engine; the first call from a thread other than the test's (a
/// worker's) waits until the test resumes it.
struct HeldHandle {
    store: Arc<Store>,
    test_thread: ThreadId,
    held: Mutex<Option<(Sender<()>, Receiver<()>)>>,
}

impl StoreHandle for HeldHandle {
    fn store(&self) -> &Store {
        if std::thread::current().id() != self.test_thread {
            if let Some((held, resume)) = self.held.lock().unwrap().take() {
                held.send(()).unwrap();
                resume.recv().unwrap();
            }
        }
        &self.store
    }
}

/// An engine over `store` whose first worker call is held: returns it with the channel that
/// reports the hold and the one that resumes it.
fn held_engine(store: &Arc<Store>) -> (TransferEngine, Receiver<()>, Sender<()>) {
    let (held_tx, held_rx) = channel();
    let (resume_tx, resume_rx) = channel();
    let handle = HeldHandle {
        store: store.clone(),
        test_thread: std::thread::current().id(),
        held: Mutex::new(Some((held_tx, resume_rx))),
    };
    // One chunk per job (of at most 8 blocks): the held call is the job's only one.
    let config = TransferConfig { chunk_blocks: 8, ..TransferConfig::default() };
    let engine = TransferEngine::new(Arc::new(handle), config).unwrap();
    (engine, held_rx, resume_tx)
}

#[test]
fn a_store_job_submitted_before_a_clear_stores_nothing_after_it() {
    let g = geometry(2, 2, 64, 16);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 4);
    let (_buf, pool) = new_pool(&g, 4);
    let (jobs, held, resume) = held_engine(&store);
    let job = jobs.submit_store(&ks, pool.clone(), &[0, 1, 2, 3]).unwrap();
    held.recv().unwrap(); // the store worker has the job, and has not called the store yet
    store.clear().unwrap();
    resume.send(()).unwrap();
    let done = jobs.wait(&[job]).unwrap().remove(0);
    let ns = store.namespace_hash();
    assert_eq!(store.lookup(ns, &ks).unwrap().hit_blocks, 0, "KV from before the clear was stored after it");
    assert_eq!(done.outcomes, vec![BlockOutcome::StoreFailed; 4]);
    // A job submitted after the clear stores as usual.
    let plain = engine(&store, TransferConfig::default());
    let again = plain.submit_store(&ks, pool, &[0, 1, 2, 3]).unwrap();
    assert_eq!(plain.wait(&[again]).unwrap()[0].done_blocks(), 4);
    assert_eq!(store.lookup(ns, &ks).unwrap().hit_blocks, 4);
}

#[test]
fn a_load_job_leased_before_a_clear_loads_nothing_after_it() {
    let g = geometry(2, 2, 64, 16);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 4);
    put_raw(&store, &ks);
    let (_buf, pool) = new_pool(&g, 4);
    let (engine, held, resume) = held_engine(&store);
    let job = engine.submit_load(&ks, pool, &[0, 1, 2, 3]).unwrap(); // leases the 4 blocks
    held.recv().unwrap(); // the read worker has the job's first chunk, not read yet
    store.clear().unwrap();
    resume.send(()).unwrap();
    let done = engine.wait(&[job]).unwrap().remove(0);
    assert_eq!(done.done_blocks(), 0, "a load served KV put before the clear: {:?}", done.outcomes);
    assert_eq!(done.outcomes, vec![BlockOutcome::ReadFailed; 4]);
    store.check_integrity().unwrap();
    assert_eq!(store.stats().leases_active, 0, "the job released its lease");
}
