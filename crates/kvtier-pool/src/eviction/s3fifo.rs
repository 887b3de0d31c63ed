//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023).
//!
//! Three FIFO queues: *small* (new blocks; ~10% of resident blocks), *main* (blocks that proved
//! themselves), and *ghost* (keys only, of blocks evicted from small). Each resident block has a
//! 2-bit access counter (0..=3). Eviction:
//! - from small when it holds at least 10% of resident blocks (or main has no victim): its
//!   oldest block moves to main if it was accessed since insertion, else it is evicted and its
//!   key remembered in ghost (quick demotion of one-hit wonders);
//! - from main otherwise: CLOCK-like — an accessed block is reinserted with its counter
//!   decremented, an unaccessed one is evicted.
//!
//! A block inserted while its key is in ghost goes straight to main.
//!
//! Sizes are in blocks, not bytes (the paper counts objects). The tier's capacity is in bytes,
//! so the 10% target is taken of the blocks currently resident, and ghost holds at most as many
//! keys as there are resident blocks (at least [`GHOST_ENTRIES_MIN`]). Pinned blocks are
//! skipped in place and keep their counters.

use kvtier_core::BlockKey;

use super::list::KeyList;
use super::policy::EvictionPolicy;

/// Share of resident blocks the small queue aims for, in percent (the paper's 10%).
pub const SMALL_QUEUE_PERCENT: usize = 10;
/// Saturation of the per-block access counter (the paper's 2 bits).
pub const FREQ_MAX: u8 = 3;
/// Ghost keeps at least this many keys, so a nearly empty cache still recognises returns.
pub const GHOST_ENTRIES_MIN: usize = 64;

#[derive(Debug)]
pub struct S3Fifo {
    small: KeyList<u8>,
    main: KeyList<u8>,
    ghost: KeyList<()>,
}

impl S3Fifo {
    pub fn new() -> Self {
        S3Fifo { small: KeyList::new(), main: KeyList::new(), ghost: KeyList::new() }
    }

    /// Blocks in (small, main, ghost), for tests and metrics.
    pub fn queue_lens(&self) -> (usize, usize, usize) {
        (self.small.len(), self.main.len(), self.ghost.len())
    }

    fn remember_in_ghost(&mut self, key: BlockKey) {
        self.ghost.remove(key);
        self.ghost.push_front(key, ());
        let bound = (self.small.len() + self.main.len()).max(GHOST_ENTRIES_MIN);
        while self.ghost.len() > bound {
            let oldest = self.ghost.tail().map(|id| self.ghost.key(id)).expect("ghost is non-empty");
            self.ghost.remove(oldest);
        }
    }

    fn evict_small(&mut self, is_evictable: &mut dyn FnMut(BlockKey) -> bool) -> Option<BlockKey> {
        let mut cursor = self.small.tail();
        while let Some(id) = cursor {
            cursor = self.small.newer(id);
            let key = self.small.key(id);
            if !is_evictable(key) {
                continue;
            }
            let accessed = *self.small.data(id) > 0;
            self.small.remove(key);
            if accessed {
                self.main.push_front(key, 0);
            } else {
                self.remember_in_ghost(key);
                return Some(key);
            }
        }
        None
    }

    fn evict_main(&mut self, is_evictable: &mut dyn FnMut(BlockKey) -> bool) -> Option<BlockKey> {
        // Terminates: each step passes a pinned block (never moved, so passed once), decrements
        // a counter (at most FREQ_MAX per block), or evicts.
        let mut cursor = self.main.tail();
        while let Some(id) = cursor {
            cursor = self.main.newer(id);
            let key = self.main.key(id);
            if !is_evictable(key) {
                continue;
            }
            let freq = self.main.data_mut(key).expect("queued key");
            if *freq > 0 {
                *freq -= 1;
                self.main.move_to_front(key);
                if cursor.is_none() {
                    cursor = self.main.tail();
                }
            } else {
                self.main.remove(key);
                return Some(key);
            }
        }
        None
    }
}

impl Default for S3Fifo {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn on_insert(&mut self, key: BlockKey) {
        if self.ghost.remove(key).is_some() {
            self.main.push_front(key, 0);
        } else {
            self.small.push_front(key, 0);
        }
    }

    fn on_access(&mut self, key: BlockKey) {
        if let Some(freq) = self.small.data_mut(key).or_else(|| self.main.data_mut(key)) {
            *freq = (*freq + 1).min(FREQ_MAX);
        }
    }

    fn on_remove(&mut self, key: BlockKey) {
        if self.small.remove(key).is_none() {
            self.main.remove(key);
        }
    }

    fn victim(&mut self, is_evictable: &mut dyn FnMut(BlockKey) -> bool) -> Option<BlockKey> {
        let resident = self.small.len() + self.main.len();
        let small_first = self.small.len() * 100 >= resident * SMALL_QUEUE_PERCENT || self.main.len() == 0;
        if small_first {
            self.evict_small(is_evictable).or_else(|| self.evict_main(is_evictable))
        } else {
            self.evict_main(is_evictable).or_else(|| self.evict_small(is_evictable))
        }
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }

    fn contains(&self, key: BlockKey) -> bool {
        self.small.contains(key) || self.main.contains(key)
    }

    fn check_integrity(&self) -> Result<(), String> {
        self.small.check_integrity()?;
        self.main.check_integrity()?;
        self.ghost.check_integrity()?;
        if let Some(key) = self.small.keys_oldest_first().find(|&k| self.main.contains(k)) {
            return Err(format!("key {key:#x} is in both the small and the main queue"));
        }
        if let Some(key) = self.ghost.keys_oldest_first().find(|&k| self.contains(k)) {
            return Err(format!("key {key:#x} is both resident and a ghost"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evict(policy: &mut S3Fifo) -> Option<BlockKey> {
        policy.victim(&mut |_| true)
    }

    #[test]
    fn one_hit_wonders_leave_first_and_become_ghosts() {
        let mut p = S3Fifo::new();
        for k in 1..=10 {
            p.on_insert(k);
        }
        p.on_access(1);
        p.on_access(2);
        // Small holds everything: 1 and 2 were accessed, so they move to main; 3 is evicted.
        assert_eq!(evict(&mut p), Some(3));
        assert_eq!(p.queue_lens(), (7, 2, 1));
        p.check_integrity().unwrap();
        // A returning ghost is admitted straight to main.
        p.on_insert(3);
        assert_eq!(p.queue_lens(), (7, 3, 0));
    }

    #[test]
    fn main_gives_accessed_blocks_a_second_chance() {
        let mut p = S3Fifo::new();
        // Insert 1..=20, access all; first eviction promotes all of small to main, then evicts
        // from main: every block has freq 0 after promotion, so the oldest promoted (1) goes.
        for k in 1..=20 {
            p.on_insert(k);
            p.on_access(k);
        }
        assert_eq!(evict(&mut p), Some(1));
        assert_eq!(p.queue_lens(), (0, 19, 0));
        // Access 2 twice: it survives two rounds of the clock; 3 is next out.
        p.on_access(2);
        p.on_access(2);
        assert_eq!(evict(&mut p), Some(3));
        p.check_integrity().unwrap();
    }

    #[test]
    fn pinned_blocks_are_skipped_everywhere() {
        let mut p = S3Fifo::new();
        for k in 1..=5 {
            p.on_insert(k);
        }
        let pinned = [1u128, 2, 3, 4, 5];
        assert_eq!(p.victim(&mut |k| !pinned.contains(&k)), None);
        assert_eq!(p.len(), 5, "nothing was lost while everything was pinned");
        assert_eq!(p.victim(&mut |k| k == 4), Some(4));
        p.check_integrity().unwrap();
    }

    #[test]
    fn ghost_is_bounded() {
        let mut p = S3Fifo::new();
        for k in 0..1000 {
            p.on_insert(k);
            if p.len() > 10 {
                evict(&mut p).unwrap();
            }
        }
        let (_, _, ghost) = p.queue_lens();
        assert!(ghost <= GHOST_ENTRIES_MIN, "ghost holds {ghost} keys");
        p.check_integrity().unwrap();
    }

    #[test]
    fn removal_is_not_remembered() {
        let mut p = S3Fifo::new();
        p.on_insert(7);
        p.on_remove(7);
        assert!(!p.contains(7));
        assert_eq!(p.queue_lens(), (0, 0, 0));
    }
}
