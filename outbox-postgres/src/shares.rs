//! Shares of a backlog between relays: while a relay's ordered claims come back
//! at least half full, it claims only the aggregates whose lock key hashes to its
//! place among the relays draining the same outbox, so that relays stop walking
//! each other's rows.
//!
//! Without shares, every relay walks the pending index from the same front: the
//! second relay steps over the first one's locked rows (a failed advisory lock
//! each), and after its first failed lock it probes the aggregate index once per
//! row it keeps, to learn whether that aggregate's lock failed earlier in the walk.
//! With four relays on two cores that cost a quarter of the drain rate
//! (docs/benchmarks-history.md, "where a second relay's time goes").
//!
//! A share is a hint, never a guarantee: per-aggregate order rests on the claim's
//! locks alone, and every row of an aggregate is in the same share (the share is
//! a function of the lock key). Relays that disagree for a moment on who is there
//! (one joined or died since another looked) may both take some aggregates' rows
//! (they meet each other's locks, as without shares) and leave others to nobody
//! until the next renewal ([`RENEW`]). A relay whose share ran dry (a claim less
//! than half full: the end of a backlog, live traffic, a hot aggregate in another
//! relay's share) claims without a share again at once, so events wait for the
//! membership to settle only while every relay is busy with a full share: those
//! of a relay that died until its row is older than [`EXPIRY`].
//!
//! Membership is a row per relay in the outbox's relays table (migration 6),
//! written outside the claim's transaction: no session state (pooler-safe), and
//! a claim held open while its batch publishes locks nothing other relays need.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// How often a relay that claims a share records that it is still there and
/// learns who else is: relays that start draining together find each other
/// within a few renewals, a small part of a drain of even 100,000 events.
pub(crate) const RENEW: Duration = Duration::from_millis(250);

/// How long after its last renewal a relay still counts: eight renewals, so that
/// a claim held while a batch publishes slowly does not drop it (and if one does,
/// the relays only overlap for a while).
pub(crate) const EXPIRY: Duration = Duration::from_secs(2);

/// This relay's place among `count` relays: it claims the aggregates whose lock
/// key modulo `count` is `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    pub(crate) index: i32,
    pub(crate) count: i32,
}

/// What to do with this relay's row before the next claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Membership {
    /// Record the relay as seen now and learn who else is.
    Renew,
    /// Delete the row: the relay claims without a share again.
    Leave,
}

/// One relay's membership (a store and its clones).
#[derive(Debug)]
pub(crate) struct Shares {
    relay: Uuid,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The last claim came back at least half full: there is a backlog to share.
    draining: bool,
    /// The relay's row may exist (written since the last leave).
    joined: bool,
    renewed: Option<Instant>,
    share: Option<Share>,
    /// The last renewal failed.
    failing: bool,
}

impl Shares {
    pub(crate) fn new() -> Self {
        Self {
            relay: Uuid::new_v4(),
            state: Mutex::new(State::default()),
        }
    }

    /// This relay's id in the relays table.
    pub(crate) fn relay(&self) -> Uuid {
        self.relay
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a few plain fields, valid after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The membership step due before the next claim, if any.
    pub(crate) fn due(&self, now: Instant) -> Option<Membership> {
        let state = self.state();
        if state.draining {
            let stale = state
                .renewed
                .is_none_or(|at| now.saturating_duration_since(at) >= RENEW);
            stale.then_some(Membership::Renew)
        } else {
            state.joined.then_some(Membership::Leave)
        }
    }

    /// The row was written at `now`; `others` are the other relays seen within
    /// [`EXPIRY`]. Returns the new share if it changed.
    pub(crate) fn renewed(&self, others: &[Uuid], now: Instant) -> Option<Option<Share>> {
        let mut state = self.state();
        state.joined = true;
        state.renewed = Some(now);
        state.failing = false;
        let share = share_of(self.relay, others);
        let changed = share != state.share;
        state.share = share;
        changed.then_some(share)
    }

    /// The row could not be written: claim without a share, try again after
    /// [`RENEW`]. Returns whether this is the first failure in a row (worth a
    /// warning; the next ones are not).
    pub(crate) fn renew_failed(&self, now: Instant) -> bool {
        let mut state = self.state();
        state.renewed = Some(now);
        state.share = None;
        !std::mem::replace(&mut state.failing, true)
    }

    /// The row is gone (or will expire).
    pub(crate) fn left(&self) {
        let mut state = self.state();
        state.joined = false;
        state.renewed = None;
        state.share = None;
    }

    /// The share the next claim takes; none unless the last claim was (half) full.
    pub(crate) fn current(&self) -> Option<Share> {
        let state = self.state();
        if state.draining {
            state.share
        } else {
            None
        }
    }

    /// A claim came back `full` (at least half as many events as asked for) or not.
    pub(crate) fn claimed(&self, full: bool) {
        self.state().draining = full;
    }
}

/// `relay`'s place among itself and `others` (ordered by id); none when alone.
fn share_of(relay: Uuid, others: &[Uuid]) -> Option<Share> {
    let others: Vec<&Uuid> = others.iter().filter(|o| **o != relay).collect();
    if others.is_empty() {
        return None;
    }
    let index = others.iter().filter(|o| ***o < relay).count();
    Some(Share {
        index: i32::try_from(index).ok()?,
        count: i32::try_from(others.len() + 1).ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    #[test]
    fn relays_take_distinct_places_in_id_order() {
        let all = [id(3), id(1), id(2)];
        let mut places: Vec<Share> = all
            .iter()
            .map(|me| share_of(*me, &all).expect("not alone"))
            .collect();
        places.sort_by_key(|s| s.index);
        let indexes: Vec<i32> = places.iter().map(|s| s.index).collect();
        assert_eq!(indexes, vec![0, 1, 2]);
        assert!(places.iter().all(|s| s.count == 3));
    }

    #[test]
    fn a_relay_alone_takes_no_share() {
        assert_eq!(share_of(id(1), &[]), None);
        assert_eq!(share_of(id(1), &[id(1)]), None);
    }

    #[test]
    fn a_share_is_taken_only_while_claims_come_back_full() {
        let shares = Shares::new();
        let t0 = Instant::now();
        assert_eq!(shares.due(t0), None, "no backlog, no row");
        shares.claimed(true);
        assert_eq!(shares.due(t0), Some(Membership::Renew));
        shares.renewed(&[id(0)], t0);
        assert!(shares.current().is_some());
        assert_eq!(shares.due(t0 + RENEW / 2), None);
        assert_eq!(shares.due(t0 + RENEW), Some(Membership::Renew));

        shares.claimed(false);
        assert_eq!(shares.current(), None, "a share ran dry: claim everything");
        assert_eq!(shares.due(t0), Some(Membership::Leave));
        shares.left();
        assert_eq!(shares.due(t0), None);
    }

    #[test]
    fn a_failed_renewal_claims_without_a_share_and_tries_again_later() {
        let shares = Shares::new();
        let t0 = Instant::now();
        shares.claimed(true);
        shares.renewed(&[id(0)], t0);
        assert!(shares.renew_failed(t0 + RENEW), "the first failure is told");
        assert!(!shares.renew_failed(t0 + RENEW), "the next ones are not");
        assert_eq!(shares.current(), None);
        assert_eq!(shares.due(t0 + RENEW + RENEW / 2), None);
        assert_eq!(shares.due(t0 + RENEW * 2), Some(Membership::Renew));
    }
}
