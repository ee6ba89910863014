//! Where an ordered claim starts its walk of the pending index.
//!
//! A published row leaves the pending index only when vacuum removes its entry, so
//! until then the index begins with entries of rows that are gone: a million after
//! a million-event drain if autovacuum has not run, tens of thousands within a
//! minute of live traffic. A walk from the beginning steps over all of them, on
//! every claim and every wake-up probe.
//!
//! Walks may start further on, at a `seq` below which nothing pending is or can
//! still become visible. The danger is a producer that took its `seq` and has not
//! committed yet (`seq` comes from a sequence when the row is inserted, and may be
//! handed out well before the commit): a walk that started past its event would
//! let a later event of the same aggregate go first. So a start is only adopted
//! from what PostgreSQL shows, in three observations (the `walk_front` statement):
//!
//! 1. An observation sees the *front*, the oldest pending event at or after the
//!    current start (held and not-due events included), and the transactions
//!    running once its snapshot was taken. A producer whose event is numbered
//!    below the front and is invisible to that snapshot took its `seq` before the
//!    front's event was committed, so it was running when the snapshot was taken:
//!    it is in that list, or it ended before the list was read.
//! 2. A later observation (started after the first one completed) sees none of
//!    those transactions running any more.
//! 3. A third observation, started after the second completed, has a snapshot in
//!    which every one of those producers' events is visible (or was rolled back).
//!    The start becomes the lower of the first front and this observation's front.
//!
//! Transactions are listed by their virtual ids, which every transaction has from
//! its start, not by transaction ids, which a producer gets only when it first
//! writes (after its `seq` was taken). A long transaction anywhere in the cluster
//! only keeps the start where it is.
//!
//! Events can re-enter the pending index below the start in one way the library
//! does itself: a dead letter retried; `DeadLetters::retry` gives its aggregate an
//! expired hold, which the claims take up through the aggregate index. Anything
//! else (rows changed by hand in SQL) is found by the periodic walk from the
//! beginning ([`FULL_WALK_EVERY`]). The identity sequence must keep its default
//! `CACHE 1`: cached numbers are handed out out of order.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often an ordered claim observes the front (one extra statement, about a
/// third of a millisecond).
pub(crate) const OBSERVE_EVERY: Duration = Duration::from_millis(25);

/// How often the start goes back to the beginning of the index, so that events put
/// back below it by hand are found within this time.
pub(crate) const FULL_WALK_EVERY: Duration = Duration::from_secs(10);

/// The walk start shared by the clones of one store.
#[derive(Debug)]
pub(crate) struct WalkStart {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The lowest `seq` a walk reads.
    from: i64,
    /// A front waiting for its running transactions to end.
    candidate: Option<Candidate>,
    last_observed: Option<Instant>,
    /// When the start last went back to the beginning.
    reset_at: Instant,
}

#[derive(Debug)]
struct Candidate {
    front: i64,
    running: HashSet<String>,
    /// When the observation that saw this front completed.
    seen_at: Instant,
    /// When an observation that saw none of `running` completed.
    all_ended_at: Option<Instant>,
}

/// What the `walk_front` statement returned.
#[derive(Debug)]
pub(crate) struct Observation {
    /// Oldest pending event at or after the start the observation was given.
    pub(crate) front: Option<i64>,
    /// Transactions running after the observation's snapshot was taken.
    pub(crate) running: Vec<String>,
    /// Just before the statement was sent.
    pub(crate) started: Instant,
    /// Just after its answer arrived.
    pub(crate) completed: Instant,
}

impl WalkStart {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            state: Mutex::new(State {
                from: i64::MIN,
                candidate: None,
                last_observed: None,
                reset_at: now,
            }),
        }
    }

    /// The start for a walk beginning `now`, and whether to observe the front
    /// first. Goes back to the beginning every [`FULL_WALK_EVERY`].
    pub(crate) fn plan(&self, now: Instant) -> (i64, bool) {
        let mut state = self.lock();
        if now.saturating_duration_since(state.reset_at) >= FULL_WALK_EVERY {
            state.from = i64::MIN;
            state.candidate = None;
            state.reset_at = now;
        }
        let observe = state
            .last_observed
            .is_none_or(|last| now.saturating_duration_since(last) >= OBSERVE_EVERY);
        if observe {
            state.last_observed = Some(now);
        }
        (state.from, observe)
    }

    /// The start walks read now.
    pub(crate) fn from(&self) -> i64 {
        self.lock().from
    }

    /// Take an observation into account (see the module documentation).
    pub(crate) fn observed(&self, seen: Observation) {
        let mut state = self.lock();
        // An observation that began before the last reset may have started past
        // events the reset is there to find.
        if seen.started < state.reset_at {
            return;
        }
        let Some(candidate) = state.candidate.as_mut() else {
            state.candidate = seen.front.map(|front| Candidate::new(front, seen));
            return;
        };
        // Only observations that began after the candidate's can tell what happened
        // to its transactions since.
        if seen.started <= candidate.seen_at {
            return;
        }
        match candidate.all_ended_at {
            Some(ended) if seen.started > ended => {
                let confirmed = seen
                    .front
                    .map_or(candidate.front, |f| f.min(candidate.front));
                state.from = state.from.max(confirmed);
                state.candidate = seen.front.map(|front| Candidate::new(front, seen));
            }
            Some(_) => {}
            None => {
                if seen.running.iter().all(|t| !candidate.running.contains(t)) {
                    candidate.all_ended_at = Some(seen.completed);
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a few numbers updated in one step: a panic elsewhere cannot
        // leave it half-written.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Candidate {
    fn new(front: i64, seen: Observation) -> Self {
        Self {
            front,
            running: seen.running.into_iter().collect(),
            seen_at: seen.completed,
            all_ended_at: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Clock(Instant);

    impl Clock {
        fn tick(&mut self) -> Instant {
            self.0 += Duration::from_millis(1);
            self.0
        }

        /// An observation taking one tick.
        fn observation(&mut self, front: Option<i64>, running: &[&str]) -> Observation {
            let started = self.tick();
            let completed = self.tick();
            Observation {
                front,
                running: running.iter().map(|t| (*t).to_owned()).collect(),
                started,
                completed,
            }
        }
    }

    #[test]
    fn the_start_moves_after_the_fronts_transactions_ended_and_a_later_look() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        start.observed(clock.observation(Some(100), &["3/1", "4/7"]));
        assert_eq!(start.from(), i64::MIN);
        // One of them still runs.
        start.observed(clock.observation(Some(150), &["4/7", "5/2"]));
        assert_eq!(start.from(), i64::MIN);
        // Both ended; the next observation may still see their events below 100.
        start.observed(clock.observation(Some(160), &["5/2"]));
        assert_eq!(start.from(), i64::MIN);
        start.observed(clock.observation(Some(90), &["5/2"]));
        assert_eq!(start.from(), 90, "the lower of the two fronts");
        // The next candidate is 90 with 5/2 running.
        start.observed(clock.observation(Some(200), &[]));
        start.observed(clock.observation(None, &[]));
        assert_eq!(start.from(), 90, "nothing pending: the candidate's front");
    }

    #[test]
    fn an_observation_that_overlapped_the_candidates_counts_for_nothing() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        let early_started = clock.tick();
        start.observed(clock.observation(Some(100), &["3/1"]));
        // Began before the candidate's observation completed: its list may predate
        // transactions of the candidate's.
        let completed = clock.tick();
        start.observed(Observation {
            front: Some(100),
            running: Vec::new(),
            started: early_started,
            completed,
        });
        start.observed(clock.observation(Some(100), &[]));
        assert_eq!(start.from(), i64::MIN, "only one observation saw them end");
        start.observed(clock.observation(Some(120), &[]));
        assert_eq!(start.from(), 100);
    }

    #[test]
    fn the_start_goes_back_to_the_beginning_periodically() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        for front in [10, 20, 30] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert_eq!(start.from(), 10);
        let later = clock.tick() + FULL_WALK_EVERY;
        assert_eq!(start.plan(later), (i64::MIN, true));
        // An observation begun before the reset is ignored.
        start.observed(Observation {
            front: Some(50),
            running: Vec::new(),
            started: clock.0,
            completed: later,
        });
        assert_eq!(start.from(), i64::MIN);
    }

    #[test]
    fn observations_are_rate_limited() {
        let now = Instant::now();
        let start = WalkStart::new(now);
        assert!(start.plan(now).1);
        assert!(!start.plan(now + OBSERVE_EVERY / 2).1);
        assert!(start.plan(now + OBSERVE_EVERY).1);
    }
}
