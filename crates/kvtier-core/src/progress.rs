//! [`LayerProgress`]: how many layers of a layerwise load are in place. The loading thread
//! advances it as each layer lands (the per-layer callback of a paged load); engine threads wait
//! for the layer they need, and closing it (the load ended, done or failed) releases every waiter.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

#[derive(Default)]
struct State {
    done: usize,
    closed: bool,
}

/// Layers `0..done_layers()` of a layerwise load are in place.
#[derive(Default)]
pub struct LayerProgress {
    state: Mutex<State>,
    changed: Condvar,
}

impl LayerProgress {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Layers `0..done` are in place (never moves back).
    pub fn advance(&self, done: usize) {
        let mut s = self.lock();
        s.done = s.done.max(done);
        self.changed.notify_all();
    }

    /// The load ended (done or failed): every waiter returns now and later waits do not block.
    pub fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    pub fn done_layers(&self) -> usize {
        self.lock().done
    }

    pub fn closed(&self) -> bool {
        self.lock().closed
    }

    /// Waits until layer `layer` is in place or the load is closed; true unless `deadline`
    /// passed first.
    pub fn wait(&self, layer: usize, deadline: Option<Instant>) -> bool {
        let mut s = self.lock();
        while s.done <= layer && !s.closed {
            s = match deadline {
                None => self.changed.wait(s).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    self.changed.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_waiter_returns_once_its_layer_is_in_place() {
        let p = Arc::new(LayerProgress::default());
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.wait(2, None))
        };
        p.advance(1);
        p.advance(3);
        assert!(waiter.join().unwrap());
        p.advance(2); // never moves back
        assert_eq!(p.done_layers(), 3);
        assert!(p.wait(2, Some(Instant::now())));
    }

    #[test]
    fn a_deadline_ends_the_wait_and_closing_releases_every_waiter() {
        let p = Arc::new(LayerProgress::default());
        assert!(!p.wait(0, Some(Instant::now() + Duration::from_millis(5))));
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.wait(7, None))
        };
        p.close();
        assert!(waiter.join().unwrap());
        assert!(p.closed());
        assert_eq!(p.done_layers(), 0);
        assert!(p.wait(9, None));
    }
}
