//! The [`EvictionPolicy`] trait every policy implements (the contract between a tier and its
//! policy is in the [module docs](super)). Its own file, below the policies and the registry,
//! so that they import it downward.

use kvtier_core::BlockKey;

/// Chooses eviction victims among a tier's blocks.
pub trait EvictionPolicy: Send {
    /// The registry name.
    fn name(&self) -> &'static str;
    /// A block became visible in the tier.
    fn on_insert(&mut self, key: BlockKey);
    /// A visible block was used (leased for a load).
    fn on_access(&mut self, key: BlockKey);
    /// A block left the tier other than through [`victim`](Self::victim); absent keys are ignored.
    fn on_remove(&mut self, key: BlockKey);
    /// Picks, forgets and returns a block with `is_evictable(key)`; `None` if there is none.
    fn victim(&mut self, is_evictable: &mut dyn FnMut(BlockKey) -> bool) -> Option<BlockKey>;
    /// Blocks tracked.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn contains(&self, key: BlockKey) -> bool;
    /// Checks the policy's own structures.
    fn check_integrity(&self) -> Result<(), String>;
}
