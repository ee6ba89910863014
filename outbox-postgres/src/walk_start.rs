//! Where a claim starts its walk of the pending index.
//!
//! A published row leaves the pending index only when vacuum removes its entry, so
//! until then the index begins with entries of rows that are gone: a million after
//! a million-event drain if autovacuum has not run, and every event published
//! since the oldest snapshot in the cluster was taken while one is held (pg_dump, a
//! long report, an idle client, a replica with `hot_standby_feedback`): vacuum may
//! not remove what that snapshot could still see. A walk from the beginning steps
//! over all of them, on every claim and every wake-up probe.
//!
//! Walks start further on, at a `seq` below which every pending event that is or
//! can still become visible belongs to a held aggregate (ordered claims take those
//! up through the holds table when the hold expires, from the hold's `from_seq`:
//! migration 7); unordered walks keep every pending event above the start. The
//! danger is a producer that took its `seq` and has not committed yet (`seq` comes
//! from a sequence when the row is inserted, and may be handed out well before the
//! commit): a walk that started past its event would let a later event of the same
//! aggregate go first. So a start is only adopted from what PostgreSQL shows, in
//! three observations (the `walk_front_*` statements):
//!
//! 1. An observation sees the *front*, the oldest pending event at or after the
//!    current start that walks must see (ordered: of an aggregate not held; not-due
//!    events included), and the producers running once its snapshot was taken. A
//!    producer whose event is numbered below the front and is invisible to that
//!    snapshot took its `seq` before the front's event was committed, so it was
//!    running when the snapshot was taken: it is in that list, or it ended before
//!    the list was read.
//! 2. A later observation (started after the first one completed) sees none of
//!    those producers running any more.
//! 3. A third observation, started after the second completed, has a snapshot in
//!    which every one of those producers' events is visible (or was rolled back).
//!    The start becomes the lower of the first front and this observation's front.
//!
//! When the first observation lists no producer (a backlog drained after the
//! producers stopped, a quiet moment), those that could commit below its front
//! had all ended before it completed: the next observation is the third, and
//! the start trails the front by one or two observations instead of two to
//! four. Under a held snapshot each claim steps over the index entries of
//! everything published since the start's observation (no walk may mark them
//! dead while the snapshot may still see their rows), so the shorter the trail,
//! the less a drain pays. Observations come every [`OBSERVE_EVERY`], and at the
//! next claim whenever a walk found its first row more than [`TRAIL_CLAIMS`]
//! claims' worth of `seq`s past the start ([`WalkStart::walked`]): at a drain's
//! pace the time-paced start trailed by thousands of events, each a dead row
//! every claim visited.
//!
//! Producers are the transactions holding a lock on the events table's sequence,
//! listed by their virtual ids: `nextval` takes that lock before it hands out a
//! number and keeps it until the transaction ends, so a producer is listed from the
//! moment it has a `seq`, before it has a transaction id. Other transactions,
//! however long, do not keep the start in place (an earlier rule waited for every
//! running transaction: one `REPEATABLE READ` session held for minutes made every
//! claim step over everything published meanwhile). A producer that stays open
//! after taking its `seq` (idle in transaction) does keep it in place, as it must.
//!
//! A relay saves its start at most every [`SAVE_EVERY`] (migration 9), and a relay
//! reads the saved one before it first walks the index: a start some relay adopted
//! stays a valid start as events are published, so a relay that starts (a deploy,
//! a restart after a crash) does not walk from the beginning of the pending index
//! (in its first claims, nor in the count of pending events it makes as it
//! starts), over every entry vacuum has not removed (under a held snapshot, every
//! event published since it was taken), until its own observations move its start.
//!
//! Events re-enter the pending index below the start in two ways the library does
//! itself, each with an expired hold on its aggregate: a dead letter retried or its
//! aggregate's dead letter purged (`DeadLetters`). Anything else (rows changed by
//! hand in SQL) is found by a look below the start every [`LOOK_BELOW_EVERY`] or
//! less often, off the claim path: its cost grows with the index entries below the
//! start, so it runs at most 1% of the time ([`LOOK_BELOW_SHARE`]). The identity
//! sequence must keep its default `CACHE 1`: cached numbers are handed out out of
//! order.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often an ordered claim observes the front (one extra statement, about a
/// third of a millisecond), unless the last walk trailed (see [`WalkStart::walked`]).
pub(crate) const OBSERVE_EVERY: Duration = Duration::from_millis(25);

/// A walk trails when it found its first row more than this many claims' worth
/// of `seq`s past the start ([`WalkStart::walked`]). At one claim, an unheld
/// ordered drain observed before nearly every other claim and ran 5-10% slower
/// than with time-paced observations (BENCHMARKS.md); at four it observes about
/// every fifth claim, and under a held snapshot each claim visits at most a few
/// claims' worth of dead rows instead of 25 ms of a drain's.
pub(crate) const TRAIL_CLAIMS: i64 = 4;

/// How often, at most, a relay looks below the start for pending events that no
/// hold accounts for (put back by hand in SQL).
pub(crate) const LOOK_BELOW_EVERY: Duration = Duration::from_secs(10);

/// How often, at most, a relay saves its walk start for relays that start later.
/// Under a held horizon each save leaves a row version vacuum cannot remove yet:
/// a few hundred an hour.
pub(crate) const SAVE_EVERY: Duration = Duration::from_secs(5);

/// Under a held horizon the look below reads every index entry below the start:
/// after a look that took `d`, the next waits at least `LOOK_BELOW_SPACING x d`, so
/// that looking takes at most 1% of the time.
const LOOK_BELOW_SPACING: u32 = 100;

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
    /// The last walk's first row was further past the start than a claim's
    /// worth of rows: observe at the next claim, whenever the last observation was.
    trailing: bool,
    /// When the start last went back (to the beginning or to an event found below
    /// it): observations begun before then may have started past that event.
    reset_at: Instant,
    /// When the next look below the start is due.
    next_look: Instant,
    /// A look below is running.
    looking: bool,
    /// The saved start (migration 9) has been read.
    restored: bool,
    /// The start last saved or read.
    saved: Option<i64>,
    /// When the next save may be.
    next_save: Instant,
    /// A save is running.
    saving: bool,
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

/// What a `walk_front_*` statement returned.
#[derive(Debug)]
pub(crate) struct Observation {
    /// Oldest pending event at or after the start the observation was given, of
    /// those walks must see.
    pub(crate) front: Option<i64>,
    /// Producers running after the observation's snapshot was taken.
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
                trailing: false,
                reset_at: now,
                next_look: now + LOOK_BELOW_EVERY,
                looking: false,
                restored: false,
                saved: None,
                next_save: now,
                saving: false,
            }),
        }
    }

    /// The start for a walk beginning `now`, and whether to observe the front
    /// first.
    pub(crate) fn plan(&self, now: Instant) -> (i64, bool) {
        let mut state = self.lock();
        let observe = state.trailing
            || state
                .last_observed
                .is_none_or(|last| now.saturating_duration_since(last) >= OBSERVE_EVERY);
        if observe {
            state.last_observed = Some(now);
            state.trailing = false;
        }
        (state.from, observe)
    }

    /// A walk from `from` found its first row at `first` (kept or not), where a
    /// claim's worth of rows is `rows`. Each `seq` between is, nearly always, an
    /// entry of an event published since the start last moved (or rolled back):
    /// under a held snapshot each costs every walk a visit of its dead row, and at
    /// a drain's pace a start that trails by [`OBSERVE_EVERY`] is thousands of
    /// them per claim. When the gap exceeds [`TRAIL_CLAIMS`] claims' worth, the
    /// next claim observes (an observation costs one walk of that gap, no more
    /// than the claims it shortens), so that under a backlog the start trails by
    /// a few claims.
    pub(crate) fn walked(&self, from: i64, first: i64, rows: i64) {
        let mut state = self.lock();
        if first.saturating_sub(from) > rows.saturating_mul(TRAIL_CLAIMS) {
            state.trailing = true;
        }
    }

    /// The start walks read now.
    pub(crate) fn from(&self) -> i64 {
        self.lock().from
    }

    /// Whether the start saved by relays (migration 9) is still to be read: once,
    /// before the first walk (claim, count or wake-up probe).
    pub(crate) fn restore_due(&self) -> bool {
        !self.lock().restored
    }

    /// Start no lower than `saved`, a start some relay adopted and saved (`None`:
    /// none saved, or it could not be read). Only the first call counts.
    pub(crate) fn restored(&self, saved: Option<i64>) {
        let mut state = self.lock();
        if state.restored {
            return;
        }
        state.restored = true;
        if let Some(saved) = saved.filter(|saved| *saved > state.from) {
            state.from = saved;
            state.saved = Some(saved);
        }
    }

    /// The start to save now, if a save is due (none running, the start moved
    /// since the last save, [`SAVE_EVERY`] passed): the caller saves it and reports
    /// with [`WalkStart::save_ended`].
    pub(crate) fn save_due(&self, now: Instant) -> Option<i64> {
        let mut state = self.lock();
        if state.saving
            || !state.restored
            || now < state.next_save
            || state.from == i64::MIN
            || state.saved == Some(state.from)
        {
            return None;
        }
        state.saving = true;
        Some(state.from)
    }

    /// A save begun with [`WalkStart::save_due`] ended at `now`, saving `saved`
    /// (`None`: it failed, and is tried again after the interval).
    pub(crate) fn save_ended(&self, saved: Option<i64>, now: Instant) {
        let mut state = self.lock();
        state.saving = false;
        if saved.is_some() {
            state.saved = saved;
        }
        state.next_save = now + SAVE_EVERY;
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

    /// Walk from `seq` on (an event found below the start), or from the beginning
    /// (`i64::MIN`), as of `now`; the start moves on again by observations begun
    /// after `now`.
    pub(crate) fn go_back(&self, seq: i64, now: Instant) {
        let mut state = self.lock();
        if seq < state.from {
            state.from = seq;
            state.candidate = None;
            state.reset_at = now;
        }
    }

    /// The start to look below now, if a look is due (and none is running): the
    /// caller runs it and reports with [`WalkStart::looked_below`].
    pub(crate) fn look_below_due(&self, now: Instant) -> Option<i64> {
        let mut state = self.lock();
        if state.looking || now < state.next_look {
            return None;
        }
        if state.from == i64::MIN {
            state.next_look = now + LOOK_BELOW_EVERY;
            return None;
        }
        state.looking = true;
        Some(state.from)
    }

    /// A look below the start begun at `started` ended at `completed`, finding the
    /// oldest pending event no hold accounts for, if any (`None` too when it
    /// failed: it is tried again at the next interval).
    pub(crate) fn looked_below(&self, found: Option<i64>, started: Instant, completed: Instant) {
        {
            let mut state = self.lock();
            state.looking = false;
            let took = completed.saturating_duration_since(started);
            state.next_look = completed + LOOK_BELOW_EVERY.max(took * LOOK_BELOW_SPACING);
        }
        if let Some(seq) = found {
            self.go_back(seq, completed);
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
        // No producer listed: every producer that could still commit an event
        // below the front had ended before the list was read, so before this
        // observation completed. The second observation is not needed; the next
        // one confirms.
        let all_ended_at = seen.running.is_empty().then_some(seen.completed);
        Self {
            front,
            running: seen.running.into_iter().collect(),
            seen_at: seen.completed,
            all_ended_at,
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
    fn with_no_producer_listed_the_next_observation_confirms() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        let overlapping = clock.tick();
        start.observed(clock.observation(Some(100), &[]));
        assert_eq!(start.from(), i64::MIN);
        // Begun before the candidate's observation completed: it counts for nothing.
        let completed = clock.tick();
        start.observed(Observation {
            front: Some(110),
            running: Vec::new(),
            started: overlapping,
            completed,
        });
        assert_eq!(start.from(), i64::MIN);
        start.observed(clock.observation(Some(120), &[]));
        assert_eq!(start.from(), 100, "the lower of the two fronts");
        start.observed(clock.observation(Some(130), &["9/1"]));
        assert_eq!(start.from(), 120);
        // 130 was seen with a producer running: the three steps again.
        start.observed(clock.observation(Some(140), &[]));
        assert_eq!(start.from(), 120, "9/1 ended; one more look");
        start.observed(clock.observation(Some(150), &[]));
        assert_eq!(start.from(), 130);
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
    fn the_start_stays_where_it_is_however_long_nothing_moves_it() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        for front in [10, 20] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert_eq!(start.from(), 10);
        let much_later = clock.tick() + LOOK_BELOW_EVERY * 100;
        assert_eq!(start.plan(much_later), (10, true));
    }

    #[test]
    fn an_event_found_below_the_start_takes_it_back_there() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        for front in [10, 20] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert_eq!(start.from(), 10);
        // Not due before the interval.
        assert_eq!(start.look_below_due(clock.tick()), None);
        let due = clock.tick() + LOOK_BELOW_EVERY;
        assert_eq!(start.look_below_due(due), Some(10));
        assert_eq!(start.look_below_due(due), None, "one look at a time");
        // An observation begun before the look ended may have started past the
        // event it found: it counts for nothing.
        let early = Observation {
            front: Some(50),
            running: Vec::new(),
            started: due,
            completed: due + Duration::from_millis(2),
        };
        start.looked_below(Some(4), due, due + Duration::from_millis(1));
        assert_eq!(start.from(), 4);
        start.observed(early);
        clock.0 = due + Duration::from_millis(3);
        for front in [4, 4, 4] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert_eq!(start.from(), 4);
    }

    #[test]
    fn a_slow_look_below_waits_a_hundred_times_its_duration() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        for front in [10, 20] {
            start.observed(clock.observation(Some(front), &[]));
        }
        let due = clock.tick() + LOOK_BELOW_EVERY;
        assert!(start.look_below_due(due).is_some());
        let took = Duration::from_millis(500);
        start.looked_below(None, due, due + took);
        assert_eq!(start.look_below_due(due + took + LOOK_BELOW_EVERY), None);
        assert!(start.look_below_due(due + took + took * 100).is_some());
    }

    #[test]
    fn a_saved_start_is_where_a_new_relay_walks_from_until_observations_move_it() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        assert!(start.restore_due());
        assert_eq!(
            start.save_due(clock.tick()),
            None,
            "nothing to save before reading"
        );
        start.restored(Some(500));
        assert!(!start.restore_due());
        assert_eq!(start.from(), 500);
        start.restored(Some(900));
        assert_eq!(start.from(), 500, "read once");
        assert_eq!(start.save_due(clock.tick()), None, "what was read is saved");
        // Observations move it on, never back below the saved start.
        for front in [400, 700] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert_eq!(
            start.from(),
            500,
            "a front below the saved start is no start"
        );
        for front in [700, 700, 700] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert_eq!(start.from(), 700);
    }

    #[test]
    fn the_start_is_saved_when_it_moved_at_most_every_interval() {
        let mut clock = Clock(Instant::now());
        let start = WalkStart::new(clock.0);
        start.restored(None);
        assert_eq!(start.from(), i64::MIN);
        assert_eq!(
            start.save_due(clock.tick()),
            None,
            "the beginning is not saved"
        );
        for front in [10, 20] {
            start.observed(clock.observation(Some(front), &[]));
        }
        let now = clock.tick();
        assert_eq!(start.save_due(now), Some(10), "the first start at once");
        assert_eq!(start.save_due(now), None, "one save at a time");
        start.save_ended(Some(10), now);
        for front in [40, 40, 40] {
            start.observed(clock.observation(Some(front), &[]));
        }
        assert!(start.from() > 10);
        assert_eq!(
            start.save_due(clock.tick()),
            None,
            "not before the interval"
        );
        let later = now + SAVE_EVERY;
        assert_eq!(start.save_due(later), Some(start.from()));
        // A failed save is tried again after the interval.
        start.save_ended(None, later);
        assert_eq!(start.save_due(later + SAVE_EVERY / 2), None);
        assert_eq!(start.save_due(later + SAVE_EVERY), Some(start.from()));
    }

    #[test]
    fn observations_are_rate_limited() {
        let now = Instant::now();
        let start = WalkStart::new(now);
        assert!(start.plan(now).1);
        assert!(!start.plan(now + OBSERVE_EVERY / 2).1);
        assert!(start.plan(now + OBSERVE_EVERY).1);
    }

    #[test]
    fn a_walk_that_trailed_by_more_than_four_claims_makes_the_next_claim_observe() {
        let now = Instant::now();
        let start = WalkStart::new(now);
        start.restored(Some(100));
        assert_eq!(start.plan(now), (100, true));
        let soon = now + OBSERVE_EVERY / 5;
        // A gap of four claims' worth of rows or less: observations keep their pace.
        start.walked(100, 100 + 4 * 200, 200);
        assert!(!start.plan(soon).1);
        // More: the next claim observes, once.
        start.walked(100, 101 + 4 * 200, 200);
        assert_eq!(start.plan(soon), (100, true));
        assert!(!start.plan(soon).1);
    }
}
