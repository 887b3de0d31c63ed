//! Eight threads put, look up, lease, load and release concurrently on a small store under
//! heavy eviction pressure, while a ninth checks integrity. Every payload is derived from its
//! key, so every loaded byte is checked: no load ever returns torn or foreign bytes, and no
//! checksum ever fails (a failure would mean a block was overwritten while leased).

use crate::common;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;

const THREADS: u64 = 8;
const OPS_PER_THREAD: usize = 400;
const PROMPTS: u32 = 8;
const PROMPT_BLOCKS: usize = 4;

struct Rng(u64);
impl Rng {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

#[test]
fn concurrent_loads_never_see_torn_or_foreign_bytes() {
    // 10 blocks of room for 32 distinct blocks: constant eviction.
    let s = store_with(10, Duration::from_secs(30), 64, "lru");
    let ns = s.namespace_hash();
    let prompts: Vec<Vec<u128>> = (0..PROMPTS).map(|p| keys(&s, p * 10_000, PROMPT_BLOCKS)).collect();
    let payloads: HashMap<u128, Vec<u8>> = prompts.iter().flatten().map(|&k| (k, payload(k))).collect();
    let verified_blocks = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                s.check_integrity().unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (s, prompts, payloads, verified) = (&s, &prompts, &payloads, &verified_blocks);
                scope.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t + 1) * 0x1234_5678));
                    let mut held: Vec<(u64, Vec<u128>)> = Vec::new();
                    let mut bufs = vec![vec![0u8; BLOCK_BYTES]; PROMPT_BLOCKS];
                    for _ in 0..OPS_PER_THREAD {
                        let k = &prompts[rng.next(u64::from(PROMPTS)) as usize];
                        match rng.next(5) {
                            0 | 1 => {
                                let n = 1 + rng.next(PROMPT_BLOCKS as u64) as usize;
                                let refs: Vec<&[u8]> = k[..n].iter().map(|key| &payloads[key][..]).collect();
                                s.put(ns, &k[..n], &refs).unwrap();
                            }
                            2 => {
                                let hit = s.lookup(ns, k).unwrap().hit_blocks;
                                assert!(hit <= PROMPT_BLOCKS);
                            }
                            3 if held.len() < 4 => {
                                let lease = s.lease(ns, k).unwrap();
                                held.push((lease.id, k[..lease.hit_blocks].to_vec()));
                            }
                            _ if !held.is_empty() => {
                                let (id, leased) = held.swap_remove(rng.next(held.len() as u64) as usize);
                                let mut dst: Vec<&mut [u8]> =
                                    bufs.iter_mut().take(leased.len()).map(|b| &mut b[..]).collect();
                                let report = s.load(id, &mut dst).unwrap();
                                assert_eq!(
                                    report.checksum_failures, 0,
                                    "a leased block changed under its lease"
                                );
                                assert_eq!(report.loaded_blocks, leased.len());
                                for (key, buf) in leased.iter().zip(&bufs) {
                                    assert!(*buf == payloads[key], "torn or foreign bytes for {key:#x}");
                                }
                                verified.fetch_add(leased.len() as u64, Ordering::Relaxed);
                                s.release(id).unwrap();
                            }
                            _ => {}
                        }
                    }
                    for (id, _) in held {
                        s.release(id).unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let stats = s.stats();
    assert_eq!(stats.checksum_failures, 0);
    assert_eq!(stats.leases_active, 0);
    assert!(stats.evictions > 0, "the test must run under eviction pressure");
    assert!(verified_blocks.load(Ordering::Relaxed) > 100, "too few blocks verified to mean anything");
    assert!(stats.used_bytes <= stats.capacity_bytes);
    s.check_integrity().unwrap();
}
