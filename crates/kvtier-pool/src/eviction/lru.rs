//! Least recently used: evict the block whose last insert or access is oldest, skipping blocks
//! the tier says are not evictable (pinned by a lease). Skipped blocks keep their place.
//!
//! Cost: O(1) per insert, access and remove; a victim search passes the pinned blocks at the
//! cold end. Leases pin blocks as they access them (moving them to the hot end), so that scan
//! is short unless leases are held for a long time.

use kvtier_core::BlockKey;

use super::list::KeyList;
use super::policy::EvictionPolicy;

#[derive(Debug)]
pub struct Lru {
    queue: KeyList<()>,
}

impl Lru {
    pub fn new() -> Self {
        Lru { queue: KeyList::new() }
    }
}

impl Default for Lru {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_insert(&mut self, key: BlockKey) {
        self.queue.push_front(key, ());
    }

    fn on_access(&mut self, key: BlockKey) {
        self.queue.move_to_front(key);
    }

    fn on_remove(&mut self, key: BlockKey) {
        self.queue.remove(key);
    }

    fn victim(&mut self, is_evictable: &mut dyn FnMut(BlockKey) -> bool) -> Option<BlockKey> {
        let mut cursor = self.queue.tail();
        while let Some(id) = cursor {
            let key = self.queue.key(id);
            if is_evictable(key) {
                self.queue.remove(key);
                return Some(key);
            }
            cursor = self.queue.newer(id);
        }
        None
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn contains(&self, key: BlockKey) -> bool {
        self.queue.contains(key)
    }

    fn check_integrity(&self) -> Result<(), String> {
        self.queue.check_integrity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(policy: &mut Lru, pinned: &[BlockKey]) -> Vec<BlockKey> {
        std::iter::from_fn(|| policy.victim(&mut |k| !pinned.contains(&k))).collect()
    }

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = Lru::new();
        for k in 1..=4 {
            lru.on_insert(k);
        }
        lru.on_access(1);
        lru.on_access(3);
        assert_eq!(drain(&mut lru, &[]), vec![2, 4, 1, 3]);
        assert!(lru.is_empty());
    }

    #[test]
    fn skips_pinned_and_keeps_them() {
        let mut lru = Lru::new();
        for k in 1..=3 {
            lru.on_insert(k);
        }
        assert_eq!(drain(&mut lru, &[1, 3]), vec![2]);
        assert_eq!(lru.len(), 2);
        assert_eq!(drain(&mut lru, &[]), vec![1, 3], "pinned blocks keep their age");
    }

    #[test]
    fn removed_keys_are_never_victims() {
        let mut lru = Lru::new();
        for k in 1..=3 {
            lru.on_insert(k);
        }
        lru.on_remove(1);
        lru.on_remove(99);
        lru.check_integrity().unwrap();
        assert_eq!(drain(&mut lru, &[]), vec![2, 3]);
    }
}
