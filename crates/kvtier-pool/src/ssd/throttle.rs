//! A token bucket: the rate limit of a *throttled device*, a test/bench device that lets two
//! files on one disk behave like two devices of different bandwidth (the striping benchmark).
//! Not for production use: a real pool runs its devices at full speed.
//!
//! Each I/O operation takes its length in tokens before it is submitted; tokens refill at
//! `rate_bytes_per_s` up to `burst_bytes`. Taking more than is there sleeps the submitting
//! worker until the debt is repaid, so over any long interval the device moves at most
//! `rate × time + burst` bytes.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Most bytes a throttled device may move at once after being idle.
pub const THROTTLE_BURST_BYTES: f64 = (1 << 20) as f64;

#[derive(Debug)]
pub struct TokenBucket {
    rate_bytes_per_s: f64,
    burst_bytes: f64,
    /// (tokens available, possibly negative; when they were last refilled)
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// A bucket refilling at `rate_bytes_per_s` (> 0, finite), initially full.
    pub fn new(rate_bytes_per_s: f64) -> Self {
        assert!(rate_bytes_per_s.is_finite() && rate_bytes_per_s > 0.0, "token rate must be positive");
        TokenBucket {
            rate_bytes_per_s,
            burst_bytes: THROTTLE_BURST_BYTES,
            state: Mutex::new((THROTTLE_BURST_BYTES, Instant::now())),
        }
    }

    pub fn rate_bytes_per_s(&self) -> f64 {
        self.rate_bytes_per_s
    }

    /// Takes `bytes` tokens; returns how long the caller must wait before using them.
    pub fn reserve(&self, bytes: usize, now: Instant) -> Duration {
        let mut state = self.state.lock();
        let (tokens, last) = *state;
        let refilled = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.rate_bytes_per_s)
            .min(self.burst_bytes);
        let left = refilled - bytes as f64;
        *state = (left, now.max(last));
        if left >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-left / self.rate_bytes_per_s)
        }
    }

    /// Takes `bytes` tokens, sleeping until they are paid for.
    pub fn take(&self, bytes: usize) {
        let wait = self.reserve(bytes, Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_is_enforced_after_the_burst() {
        let bucket = TokenBucket::new(1e6);
        let t0 = Instant::now();
        assert_eq!(bucket.reserve(1 << 20, t0), Duration::ZERO, "the burst is free");
        let wait = bucket.reserve(500_000, t0);
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        // One second later the debt is repaid and 500 kB more have accrued.
        assert_eq!(bucket.reserve(500_000, t0 + Duration::from_secs(1)), Duration::ZERO);
        assert!(bucket.reserve(1, t0 + Duration::from_secs(1)) > Duration::ZERO);
    }

    #[test]
    fn idle_time_never_buys_more_than_the_burst() {
        let bucket = TokenBucket::new(1e6);
        let later = Instant::now() + Duration::from_secs(100);
        let wait = bucket.reserve(2 << 20, later);
        assert!((wait.as_secs_f64() - 1.048_576).abs() < 1e-6, "{wait:?}");
    }
}
