//! A flipped bit in a stored object is detected on read: the read reports it, the block is
//! counted and doomed (lookups miss it), and its space is freed once unpinned.

use std::sync::Arc;

use kvtier_core::parallel::WorkerPool;
use kvtier_pool::{eviction_by_name, DramTier, ReadOutcome, Tier, PAGE_BYTES};

const NS: u128 = 77;

fn setup() -> (DramTier, Vec<Vec<u8>>) {
    let t = DramTier::new(64 * PAGE_BYTES, eviction_by_name("lru").unwrap(), Arc::new(WorkerPool::new(2)))
        .unwrap();
    let payloads: Vec<Vec<u8>> = (0..4u8).map(|k| vec![k.wrapping_mul(17); 9000]).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    assert_eq!(t.put(NS, &[0, 1, 2, 3], &refs).stored, 4);
    (t, payloads)
}

#[test]
fn corrupt_block_is_reported_counted_and_dropped() {
    let (t, payloads) = setup();
    assert!(t.corrupt_for_test(2, 8999));
    assert!(!t.corrupt_for_test(2, 9000), "offset past the payload");
    assert!(!t.corrupt_for_test(99, 0), "absent key");
    let mut located = vec![None; 4];
    assert_eq!(t.locate(NS, &[0, 1, 2, 3], &mut located, true, true), 4);
    let entries: Vec<_> = located.iter().map(|l| l.unwrap().entry).collect();
    let mut bufs = vec![vec![0u8; 9000]; 4];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let mut outcomes = vec![ReadOutcome::NotPinned; 4];
    t.read_pinned(NS, &entries, &mut dst, &mut outcomes);
    assert_eq!(
        outcomes,
        [ReadOutcome::Loaded, ReadOutcome::Loaded, ReadOutcome::Corrupt, ReadOutcome::Loaded]
    );
    for i in [0, 1, 3] {
        assert_eq!(bufs[i], payloads[i]);
    }
    assert_eq!(t.stats().checksum_failures, 1);
    assert!(!t.contains(NS, 2), "a corrupt block is a miss from now on");
    let used_while_pinned = t.used_bytes();
    t.check_integrity().unwrap();
    t.unpin(&entries);
    assert!(t.used_bytes() < used_while_pinned, "the doomed block's space is freed on unpin");
    t.check_integrity().unwrap();
}

#[test]
fn wrong_namespace_on_read_is_corrupt_not_served() {
    let (t, _) = setup();
    let mut located = vec![None];
    t.locate(NS, &[1], &mut located, true, true);
    let entry = located[0].unwrap().entry;
    let mut buf = vec![0u8; 9000];
    let mut outcomes = [ReadOutcome::NotPinned];
    t.read_pinned(NS + 1, &[entry], &mut [&mut buf[..]], &mut outcomes);
    assert_eq!(outcomes[0], ReadOutcome::Corrupt);
    t.unpin(&[entry]);
    t.check_integrity().unwrap();
}

#[test]
fn unpinned_entries_are_not_read() {
    let (t, _) = setup();
    let mut located = vec![None];
    t.locate(NS, &[1], &mut located, false, true);
    let mut buf = vec![0u8; 9000];
    let mut outcomes = [ReadOutcome::Loaded];
    t.read_pinned(NS, &[located[0].unwrap().entry], &mut [&mut buf[..]], &mut outcomes);
    assert_eq!(outcomes[0], ReadOutcome::NotPinned);
    assert!(buf.iter().all(|&b| b == 0));
}

#[test]
fn a_corrupt_copy_is_counted_once_and_fails_every_later_read() {
    let (t, payloads) = setup();
    assert!(t.corrupt_for_test(1, 0));
    let read = |entries: &[kvtier_pool::EntryRef]| {
        let mut bufs = vec![vec![0u8; 9000]; entries.len()];
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let mut outcomes = vec![ReadOutcome::NotPinned; entries.len()];
        t.read_pinned(NS, entries, &mut dst, &mut outcomes);
        (outcomes, bufs)
    };
    let mut first = vec![None; 2];
    t.locate(NS, &[0, 1], &mut first, true, true);
    let first: Vec<_> = first.iter().map(|l| l.unwrap().entry).collect();
    let mut second = vec![None; 2];
    t.locate(NS, &[0, 1], &mut second, true, true);
    let second: Vec<_> = second.iter().map(|l| l.unwrap().entry).collect();
    assert_eq!(read(&first).0, [ReadOutcome::Loaded, ReadOutcome::Corrupt]);
    assert_eq!(t.stats().checksum_failures, 1);
    for entries in [&first, &second, &first] {
        let (outcomes, bufs) = read(entries);
        assert_eq!(outcomes, [ReadOutcome::Loaded, ReadOutcome::CorruptKnown], "the doomed copy fails again");
        assert_eq!(bufs[0], payloads[0]);
        assert_eq!(t.stats().checksum_failures, 1, "but is not counted again");
        t.check_integrity().unwrap();
    }
    t.unpin(&first);
    t.unpin(&second);
    t.check_integrity().unwrap();
}

#[test]
fn pinned_blocks_are_not_corrupted() {
    // A pinned block may be being read; flipping a bit then would race with the read.
    let (t, payloads) = setup();
    let mut located = vec![None];
    t.locate(NS, &[3], &mut located, true, true);
    let entry = located[0].unwrap().entry;
    assert!(!t.corrupt_for_test(3, 0));
    let mut buf = vec![0u8; 9000];
    let mut outcomes = [ReadOutcome::NotPinned];
    t.read_pinned(NS, &[entry], &mut [&mut buf[..]], &mut outcomes);
    assert_eq!((outcomes[0], &buf), (ReadOutcome::Loaded, &payloads[3]));
    t.unpin(&[entry]);
    assert!(t.corrupt_for_test(3, 0), "unpinned again: flipped");
}
