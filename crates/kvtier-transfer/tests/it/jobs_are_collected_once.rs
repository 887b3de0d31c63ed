//! Each job is reported exactly once (docs/transfer.md §1), also when callers on several threads
//! collect it: two `wait`s of the same job, or a `wait` and a `finished()`, return it once; the
//! other one errors (`UnknownJob`: already collected). Jobs are held on their worker by a store
//! handle that blocks the workers' first calls (channels) while the collectors start waiting.

use crate::common;

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use common::{geometry, keys, new_pool, store};
use kvtier_store::Store;
use kvtier_transfer::{BlockOutcome, StoreHandle, TransferConfig, TransferEngine, TransferError};

/// The store; each of the first calls from a thread other than the test's (a worker's) reports
/// itself on its gate's channel and waits until the test resumes it.
struct HeldHandle {
    store: Arc<Store>,
    test_thread: ThreadId,
    gates: Mutex<VecDeque<(Sender<()>, Receiver<()>)>>,
}

impl StoreHandle for HeldHandle {
    fn store(&self) -> &Store {
        if std::thread::current().id() != self.test_thread {
            let gate = self.gates.lock().unwrap().pop_front();
            if let Some((held, resume)) = gate {
                held.send(()).unwrap();
                resume.recv().unwrap();
            }
        }
        &self.store
    }
}

/// `n` store jobs of one chunk each on one store worker, each held in its store call in turn:
/// the engine, the jobs, the channel that reports a job held and the ones that resume each.
fn held_store_jobs(n: usize) -> (TransferEngine, Vec<u64>, Receiver<()>, Vec<Sender<()>>) {
    let g = geometry(2, 2, 64, 16);
    let store = store(g.clone(), 16);
    let ks = keys(&store, 0, 4 * n);
    let (_buf, pool) = new_pool(&g, 4 * n as u64);
    let (held_tx, held_rx) = channel();
    let (resumes, gates): (Vec<_>, VecDeque<_>) =
        (0..n).map(|_| channel()).map(|(tx, rx)| (tx, (held_tx.clone(), rx))).unzip();
    let handle = HeldHandle {
        store: store.clone(),
        test_thread: std::thread::current().id(),
        gates: Mutex::new(gates),
    };
    let config = TransferConfig { chunk_blocks: 8, store_workers: 1, ..TransferConfig::default() };
    let engine = TransferEngine::new(Arc::new(handle), config).unwrap();
    let jobs = (0..n)
        .map(|j| {
            let ids: Vec<u64> = (4 * j as u64..4 * j as u64 + 4).collect();
            engine.submit_store(&ks[4 * j..4 * j + 4], pool.clone(), &ids).unwrap()
        })
        .collect();
    held_rx.recv().unwrap(); // the first job is in its store call
    (engine, jobs, held_rx, resumes)
}

/// The waiters get their chance to start waiting before the job finishes (a late one finds the
/// job collected, which the assertions accept as well: they check what was reported, not when).
fn let_waiters_start() {
    std::thread::sleep(Duration::from_millis(200));
}

#[test]
fn two_waits_of_one_job_report_it_once() {
    let (engine, jobs, _held, resume) = held_store_jobs(1);
    let job = jobs[0];
    let results = std::thread::scope(|s| {
        let waiters: Vec<_> = (0..2).map(|_| s.spawn(|| engine.wait(&[job]))).collect();
        let_waiters_start();
        resume[0].send(()).unwrap();
        waiters.into_iter().map(|w| w.join().unwrap()).collect::<Vec<_>>()
    });
    let reported: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).flatten().collect();
    assert_eq!(reported.len(), 1, "the job was reported {} times: {results:?}", reported.len());
    assert!(reported[0].outcomes.iter().all(|&o| o == BlockOutcome::Done));
    let errors: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errors, vec![&TransferError::UnknownJob { id: job }]);
    assert_eq!(engine.jobs(), 0);
    assert!(engine.finished().is_empty());
}

/// A `wait` on two jobs, the first of which `finished()` collects while the wait still waits for
/// the second (held in its store call): the wait reports neither again, and leaves the second
/// to be collected.
#[test]
fn a_job_finished_collects_while_a_wait_waits_for_it_is_reported_once() {
    let (engine, jobs, held, resume) = held_store_jobs(2);
    let (waited, collected) = std::thread::scope(|s| {
        let waiter = s.spawn(|| engine.wait(&jobs));
        let_waiters_start();
        resume[0].send(()).unwrap();
        held.recv().unwrap(); // the first job finished; the second is held
        let mut collected = Vec::new();
        while collected.is_empty() {
            collected = engine.finished();
        }
        resume[1].send(()).unwrap();
        (waiter.join().unwrap(), collected)
    });
    assert_eq!(collected.iter().map(|j| j.id).collect::<Vec<_>>(), vec![jobs[0]]);
    match waited {
        // The waiter started after the collection (not what this test is after), or saw it.
        Err(e) => assert_eq!(e, TransferError::UnknownJob { id: jobs[0] }),
        Ok(reported) => panic!("job {} was reported by finished() and again by wait: {reported:?}", jobs[0]),
    }
    let rest = engine.wait(&jobs[1..]).unwrap();
    assert!(rest[0].outcomes.iter().all(|&o| o == BlockOutcome::Done));
    assert_eq!(engine.jobs(), 0);
}

#[test]
fn a_wait_given_one_job_twice_is_refused_and_collects_nothing() {
    let (engine, jobs, _held, resume) = held_store_jobs(1);
    resume[0].send(()).unwrap();
    let job = jobs[0];
    assert_eq!(engine.wait(&[job, job]), Err(TransferError::RepeatedJob { id: job }));
    assert_eq!(engine.jobs(), 1, "the refused wait collected nothing");
    assert_eq!(engine.wait(&[job]).unwrap().len(), 1);
}
