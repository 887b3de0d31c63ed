//! Where keys are, without pinning or reading them: [`Store::lookup`] (the hit prefix) and
//! [`Store::lookup_each`] (key by key). [`Store::lease`] locates the same way and pins.

use kvtier_core::BlockKey;
use kvtier_pool::TierKind;

use super::Store;
use crate::error::StoreError;
use crate::types::Lookup;

impl Store {
    /// The longest consecutive prefix of `keys` present in any tier, and where each block is.
    /// Nothing is pinned: use [`lease`](Self::lease) before loading.
    pub fn lookup(&self, namespace_hash: u128, keys: &[BlockKey]) -> Result<Lookup, StoreError> {
        self.check_namespace(namespace_hash)?;
        let mut located = vec![None; keys.len()];
        let hit_blocks = self.locate(keys, &mut located, false);
        let tiers = located[..hit_blocks].iter().map(|l| l.expect("prefix is located").tier).collect();
        Ok(Lookup { hit_blocks, tiers })
    }

    /// Where each of `keys` is, on its own: the tier holding it, or `None`. Unlike
    /// [`lookup`](Self::lookup), keys after a missing one are asked too (a hybrid model's state
    /// snapshots exist at some page boundaries only; each tier is asked once for all of them).
    /// Nothing is pinned. Counted as one lookup; hit and miss blocks count prefixes only, so
    /// they are left as they are.
    pub fn lookup_each(
        &self,
        namespace_hash: u128,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<TierKind>>, StoreError> {
        self.check_namespace(namespace_hash)?;
        let mut located = vec![None; keys.len()];
        for tier in self.tiers() {
            tier.locate(self.namespace_hash, keys, &mut located, false, false);
        }
        self.counters.lookups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(located.iter().map(|l| l.map(|l| l.tier)).collect())
    }
}
