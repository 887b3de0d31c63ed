//! Under any sequence of put / lease / load / release (and corruption), the store never uses
//! more than its capacity, every load returns exact bytes for its verified prefix, and
//! `check_integrity` (allocator accounting, index, headers, pins == leases) holds after every step.

use crate::common;
use std::time::Duration;

use common::*;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Put { prompt: u32, start: usize, len: usize },
    Lease { prompt: u32, len: usize },
    Load { lease: usize, len: usize },
    Release { lease: usize },
    Corrupt { prompt: u32, block: usize },
}

const PROMPTS: u32 = 5;
const PROMPT_BLOCKS: usize = 6;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Mostly whole prefixes (what an engine stores), sometimes a middle range (a hole).
        4 => (0..PROMPTS, prop_oneof![3 => Just(0), 1 => 0..PROMPT_BLOCKS], 1..=PROMPT_BLOCKS)
            .prop_map(|(prompt, start, len)| Op::Put { prompt, start, len }),
        3 => (0..PROMPTS, 1..=PROMPT_BLOCKS).prop_map(|(prompt, len)| Op::Lease { prompt, len }),
        4 => (any::<usize>(), 0..=PROMPT_BLOCKS).prop_map(|(lease, len)| Op::Load { lease, len }),
        2 => any::<usize>().prop_map(|lease| Op::Release { lease }),
        // Early blocks are the ones most often stored and leased, so corruption there is seen.
        1 => (0..PROMPTS, 0..3usize).prop_map(|(prompt, block)| Op::Corrupt { prompt, block }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_operations_never_exceed_capacity(ops in proptest::collection::vec(op(), 1..60), s3fifo in any::<bool>(), blocks in 1u64..10) {
        let s = store_with(blocks, Duration::from_secs(30), 8, if s3fifo { "s3fifo" } else { "lru" });
        let ns = s.namespace_hash();
        let prompts: Vec<Vec<u128>> = (0..PROMPTS).map(|p| keys(&s, p * 10_000, PROMPT_BLOCKS)).collect();
        // (lease id, keys it covers)
        let mut leases: Vec<(u64, Vec<u128>)> = Vec::new();
        for op in ops {
            match op {
                Op::Put { prompt, start, len } => {
                    let end = (start + len).min(PROMPT_BLOCKS);
                    let r = put_keys(&s, &prompts[prompt as usize][start..end]);
                    prop_assert_eq!(r.stored + r.already_present + r.rejected, end - start);
                }
                Op::Lease { prompt, len } => {
                    let k = &prompts[prompt as usize][..len];
                    match s.lease(ns, k) {
                        Ok(lease) => {
                            prop_assert_eq!(lease.tiers.len(), lease.hit_blocks);
                            leases.push((lease.id, k[..lease.hit_blocks].to_vec()));
                        }
                        Err(e) => prop_assert_eq!(e, kvtier_store::StoreError::LeaseLimit { max: 8 }),
                    }
                }
                Op::Load { lease, len } if !leases.is_empty() => {
                    let (id, k) = &leases[lease % leases.len()];
                    let n = len.min(k.len());
                    let (report, bufs) = load(&s, *id, n);
                    prop_assert!(report.loaded_blocks <= n);
                    prop_assert_eq!(report.loaded_blocks < n, report.checksum_failures > 0);
                    for (key, buf) in k.iter().zip(&bufs).take(report.loaded_blocks) {
                        prop_assert!(*buf == payload(*key), "wrong bytes served for {:#x}", key);
                    }
                }
                Op::Release { lease } if !leases.is_empty() => {
                    let (id, _) = leases.swap_remove(lease % leases.len());
                    prop_assert_eq!(s.release(id), Ok(()));
                }
                Op::Corrupt { prompt, block } => {
                    s.corrupt_for_test(prompts[prompt as usize][block], block * 1000);
                }
                _ => {}
            }
            let stats = s.stats();
            prop_assert!(stats.used_bytes <= stats.capacity_bytes, "{} > {}", stats.used_bytes, stats.capacity_bytes);
            prop_assert_eq!(stats.capacity_bytes, blocks * OBJECT_BYTES);
            prop_assert_eq!(stats.leases_active as usize, leases.len());
            prop_assert_eq!(s.check_integrity(), Ok(()));
        }
        for (id, _) in leases {
            s.release(id).unwrap();
        }
        prop_assert_eq!(s.check_integrity(), Ok(()));
    }
}
