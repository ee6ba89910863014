//! Whether a running relay still makes progress: each claim loop records when it
//! last finished a cycle, so that a liveness probe can tell a stuck relay (a
//! database call or a publish that never returns, a deadlock) from a busy or
//! failing one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// When each claim loop of a [`crate::Relay`] last finished a cycle.
///
/// A cycle is one claim and, if it found events, their publishing and recording;
/// or, if it found nothing, the wait for new events; or, after a store error, the
/// pause before the next claim. A loop that fails still finishes cycles: this
/// tells *stuck*, not *healthy* (readiness checks the database and the broker).
/// The longest normal cycle is about `publish_timeout` plus the database's time
/// for a claim and a record, plus `poll_interval`.
#[derive(Debug, Default)]
pub struct Liveness {
    /// One entry per claim loop while the relay runs; empty otherwise.
    loops: Mutex<Vec<Instant>>,
}

impl Liveness {
    /// The longest any claim loop has gone since it last finished a cycle (or
    /// started), as of `now`; `None` when the relay is not running.
    pub fn stalled_for(&self, now: Instant) -> Option<Duration> {
        self.lock()
            .iter()
            .map(|last| now.saturating_duration_since(*last))
            .max()
    }

    pub(crate) fn started(&self, loops: usize, now: Instant) {
        *self.lock() = vec![now; loops];
    }

    pub(crate) fn finished_cycle(&self, worker: usize, now: Instant) {
        if let Some(last) = self.lock().get_mut(worker) {
            *last = now;
        }
    }

    pub(crate) fn stopped(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Instant>> {
        // Instants written in one step: a panic elsewhere cannot leave them torn.
        self.loops
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_loop_counts_and_a_stopped_relay_has_no_answer() {
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        let liveness = Liveness::default();
        assert_eq!(liveness.stalled_for(t0), None);
        liveness.started(2, t0);
        liveness.finished_cycle(0, at(5));
        assert_eq!(
            liveness.stalled_for(at(6)),
            Some(Duration::from_secs(6)),
            "loop 1 has not finished a cycle since the start"
        );
        liveness.finished_cycle(1, at(6));
        assert_eq!(liveness.stalled_for(at(7)), Some(Duration::from_secs(2)));
        liveness.stopped();
        assert_eq!(liveness.stalled_for(at(8)), None);
    }
}
