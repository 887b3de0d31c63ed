//! Eviction policies: which unpinned block a full tier gives up. One file per policy behind
//! [`EvictionPolicy`]; [`by_name`] is the registry.
//!
//! Contract between a tier and its policy:
//! - the policy tracks exactly the blocks the tier can serve (published, not doomed): the tier
//!   calls `on_insert` when a block becomes visible and `on_remove` when it leaves for any
//!   reason other than being chosen by `victim`;
//! - `victim` chooses a block for which `is_evictable` is true (the tier says false for pinned
//!   blocks), forgets it, and returns it; the tier must then evict it. `None` means every
//!   tracked block is pinned (or none is tracked).

mod list;
pub mod lru;
mod policy;
pub mod s3fifo;

use crate::error::PoolError;
pub use lru::Lru;
pub use policy::EvictionPolicy;
pub use s3fifo::S3Fifo;

/// Registered policy names, in the order error messages list them.
pub const POLICY_NAMES: [&str; 2] = ["lru", "s3fifo"];

/// A new policy by registry name; an unknown name is an error listing the known ones.
pub fn by_name(name: &str) -> Result<Box<dyn EvictionPolicy>, PoolError> {
    match name {
        "lru" => Ok(Box::new(Lru::new())),
        "s3fifo" => Ok(Box::new(S3Fifo::new())),
        _ => Err(PoolError::UnknownEviction { name: name.to_string(), known: POLICY_NAMES.join(", ") }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_builds_every_name_and_rejects_others() {
        for name in POLICY_NAMES {
            assert_eq!(by_name(name).unwrap().name(), name);
        }
        let err = by_name("arc").err().unwrap();
        let message = err.to_string();
        assert!(message.contains("\"arc\"") && message.contains("lru, s3fifo"), "{message}");
    }
}
