//! A tier that stores nothing: every put is rejected, every lookup misses. For tests, and for
//! measuring the overhead of the store's bookkeeping without any copy.

use kvtier_core::BlockKey;

use crate::tier::{
    ClearError, EntryRef, IntegrityError, Located, ReadOutcome, Tier, TierKind, TierPutReport, TierStats,
};

#[derive(Debug, Default)]
pub struct NoopTier;

impl Tier for NoopTier {
    fn kind(&self) -> TierKind {
        TierKind::Noop
    }
    fn capacity_bytes(&self) -> u64 {
        0
    }
    fn used_bytes(&self) -> u64 {
        0
    }
    fn put(&self, _namespace: u128, keys: &[BlockKey], payloads: &[&[u8]]) -> TierPutReport {
        assert_eq!(keys.len(), payloads.len(), "one payload per key");
        TierPutReport { rejected: keys.len(), ..TierPutReport::default() }
    }
    fn locate(
        &self,
        _ns: u128,
        keys: &[BlockKey],
        located: &mut [Option<Located>],
        _pin: bool,
        _stop: bool,
    ) -> usize {
        assert_eq!(keys.len(), located.len(), "one slot per key");
        0
    }
    fn read_pinned(
        &self,
        _ns: u128,
        entries: &[EntryRef],
        dst: &mut [&mut [u8]],
        outcomes: &mut [ReadOutcome],
    ) {
        assert!(entries.len() == dst.len() && dst.len() == outcomes.len(), "one destination per entry");
        outcomes.fill(ReadOutcome::NotPinned);
    }
    fn unpin(&self, entries: &[EntryRef]) {
        assert!(entries.is_empty(), "unpin of {:?}: the noop tier holds no pins", entries[0]);
    }
    fn contains(&self, _ns: u128, _key: BlockKey) -> bool {
        false
    }
    fn remove(&self, _ns: u128, _keys: &[BlockKey]) -> usize {
        0
    }
    fn clear(&self, _ns: u128) -> Result<usize, ClearError> {
        Ok(0)
    }
    fn pins(&self) -> Vec<(EntryRef, u32)> {
        Vec::new()
    }
    fn stats(&self) -> TierStats {
        TierStats::default()
    }
    fn check_integrity(&self) -> Result<(), IntegrityError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_nothing() {
        let tier = NoopTier;
        let report = tier.put(1, &[5], &[&[0u8; 8]]);
        assert_eq!((report.stored, report.rejected), (0, 1));
        let mut located = [None];
        assert_eq!(tier.locate(1, &[5], &mut located, true, true), 0);
        assert!(located[0].is_none() && !tier.contains(1, 5));
        tier.check_integrity().unwrap();
    }
}
