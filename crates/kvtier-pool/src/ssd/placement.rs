//! Which device each object of a batch goes to.
//!
//! **Bandwidth** placement is Algorithm 1 of the Unified KV pooling paper (§IV-A3, §IV-C1):
//! device `i` with bandwidth `b_i` has placement ratio `p_i = b_i / Σ b_j`; a batch of `n`
//! objects gives device `i` first `⌊p_i · n⌋` objects, then the `r = n − Σ⌊p_i · n⌋` remaining
//! ones go one each to the devices with the largest `p_i` (ties: the lower index). Objects are
//! taken in the batch's (layerwise) order and fill the devices' quotas in device order, so each
//! device gets a contiguous run of the batch.
//!
//! The paper's line 10 says "select pool device with the largest p_i" for each remainder; its
//! prose says the remainder goes "to the devices with larger p_i". We read both as: largest
//! first, one each (`r < N`, so no device gets two), which is the only reading under which
//! every device's count stays within one of its exact share `p_i · n`.
//!
//! Floors are computed in exact integer arithmetic over bandwidths rounded to whole bytes/s,
//! so the counts are reproducible (no `0.3 × 10 = 2.9999…` off-by-one).
//!
//! **Round-robin** gives object `j` of the batch to device `(start + j) mod N`, with `start`
//! advancing across batches (so batches of one object do not all land on device 0).

/// Largest integer weight a bandwidth becomes: larger bandwidths are all scaled down (ratios
/// kept), so that a sum of weights times any object count fits a u128. Below it an f64 is an
/// exact integer, so real bandwidths (bytes/s) are used as they are.
const WEIGHT_MAX: f64 = (1u64 << 53) as f64;

/// `n` split over devices by Algorithm 1. `bandwidths` are bytes/s (any positive scale);
/// all-zero or empty bandwidths are treated as equal.
pub fn algorithm1_counts(bandwidths: &[f64], n: usize) -> Vec<usize> {
    let devices = bandwidths.len();
    assert!(devices > 0, "placement over no devices");
    let usable = |b: f64| b.is_finite() && b > 0.0;
    let fastest = bandwidths.iter().copied().filter(|&b| usable(b)).fold(0.0, f64::max);
    let scale = if fastest > WEIGHT_MAX { WEIGHT_MAX / fastest } else { 1.0 };
    let weights: Vec<u128> = bandwidths
        .iter()
        .map(|&b| if usable(b) { (b * scale).round().max(1.0) as u128 } else { 0 })
        .collect();
    let total: u128 = weights.iter().sum();
    let weights = if total == 0 { vec![1u128; devices] } else { weights };
    let total: u128 = weights.iter().sum();
    // Lines 4–7: target_count_i = ⌊p_i · |K|⌋.
    let mut counts: Vec<usize> = weights.iter().map(|&w| (w * n as u128 / total) as usize).collect();
    // Line 8: the remainder after flooring.
    let remaining = n - counts.iter().sum::<usize>();
    assert!(remaining < devices || n == 0, "flooring loses less than one object per device");
    // Lines 9–12: one each to the largest ratios (ties: lower index first).
    let mut by_share: Vec<usize> = (0..devices).collect();
    by_share.sort_by(|&a, &b| weights[b].cmp(&weights[a]).then(a.cmp(&b)));
    for &device in by_share.iter().take(remaining) {
        counts[device] += 1;
    }
    counts
}

/// Lines 13–16: the device of each of `n` objects, in order, filling device 0's quota first.
pub fn assign_in_order(counts: &[usize]) -> Vec<usize> {
    counts.iter().enumerate().flat_map(|(device, &c)| std::iter::repeat(device).take(c)).collect()
}

/// Round-robin: the device of each of `n` objects starting at device `start`.
pub fn round_robin(devices: usize, start: usize, n: usize) -> Vec<usize> {
    (0..n).map(|j| (start + j) % devices).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn paper_style_examples() {
        // 3:1 bandwidth, 10 objects: floors 7 and 2, one left over to the faster device.
        assert_eq!(algorithm1_counts(&[3e9, 1e9], 10), vec![8, 2]);
        // Equal bandwidth, odd count: the remainder goes to the lower index.
        assert_eq!(algorithm1_counts(&[1.0, 1.0, 1.0], 7), vec![3, 2, 2]);
        // 10 × 0.2, 0.3, 0.5 floors to exactly 2, 3, 5 (no float off-by-one), no remainder.
        assert_eq!(algorithm1_counts(&[2.0, 3.0, 5.0], 10), vec![2, 3, 5]);
        // Remainder 2 goes to the two largest shares, not twice to the largest.
        assert_eq!(algorithm1_counts(&[5.0, 3.0, 2.0], 3), vec![2, 1, 0]);
        assert_eq!(algorithm1_counts(&[2.0, 3.0, 5.0], 1), vec![0, 0, 1]);
        assert_eq!(algorithm1_counts(&[1.0, 4.0], 0), vec![0, 0]);
        // A failed probe (all zero) is equal shares.
        assert_eq!(algorithm1_counts(&[0.0, 0.0], 5), vec![3, 2]);
        assert_eq!(assign_in_order(&[2, 0, 1]), vec![0, 0, 2]);
        assert_eq!(round_robin(3, 2, 4), vec![2, 0, 1, 2]);
    }

    #[test]
    fn bandwidths_past_exact_integers_keep_their_ratios() {
        // Rounded to u128 as they were, these saturated and their sum wrapped: a panic, or
        // [f64::MAX, 1.0] summing to 0 (equal shares).
        assert_eq!(algorithm1_counts(&[1e300, 1e300], 8), vec![4, 4]);
        assert_eq!(algorithm1_counts(&[3e300, 1e300], 10), vec![8, 2]);
        assert_eq!(algorithm1_counts(&[f64::MAX, 1.0], 8), vec![8, 0]);
        assert_eq!(
            algorithm1_counts(&[2e38, 2e38, 2e38], usize::MAX),
            algorithm1_counts(&[1.0; 3], usize::MAX)
        );
    }

    proptest! {
        #[test]
        fn counts_sum_and_stay_within_one_of_the_share(
            bandwidths in proptest::collection::vec(1u32..10_000, 1..8), n in 0usize..5000
        ) {
            let b: Vec<f64> = bandwidths.iter().map(|&x| f64::from(x)).collect();
            let counts = algorithm1_counts(&b, n);
            prop_assert_eq!(counts.iter().sum::<usize>(), n);
            let total: f64 = b.iter().sum();
            for (i, &c) in counts.iter().enumerate() {
                let share = b[i] / total * n as f64;
                prop_assert!((c as f64) >= share.floor() - 1e-9 && (c as f64) <= share.floor() + 1.0 + 1e-9);
            }
            prop_assert_eq!(assign_in_order(&counts).len(), n);
        }
    }
}
