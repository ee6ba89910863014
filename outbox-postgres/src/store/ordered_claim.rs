//! The ordered claim: runs of events per aggregate, in two statements.
//!
//! Step 1 (`sql::claim_aggregates`) walks the oldest pending events from the walk
//! start and takes a transaction-scoped advisory lock per aggregate, in the window
//! of this relay's share; step 2 (`sql::claim_runs`) reads each locked aggregate's
//! events in insertion order with a snapshot taken after the locks. Rows that may
//! have changed between the two (a concurrent claim's, a producer's late commit)
//! are read again. An aggregate whose head is not due, is dead-lettered with
//! `block`, or failed is held (a row in the holds table) so that its followers
//! cost nothing until it is due. The SQL is in `sql.rs` with the crate's other
//! statements; the rules are in docs/design.md, "One batch".

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use chrono::{DateTime, Utc};
use pgoutbox_core::Event;
use sqlx::postgres::PgRow;
use sqlx::PgConnection;

use super::PgStore;
use crate::error::Result;
use crate::row::{self, column, column::read_again, column::walked};
use crate::sql::{self, AfterDeadLetter, Sql};

impl PgStore {
    /// The ordered claim: lock aggregates while reading their runs, and read them
    /// again if something may have changed them meanwhile (see `sql::claim_aggregates`).
    pub(super) async fn claim_runs(
        &self,
        tx: &mut PgConnection,
        limit: i64,
    ) -> Result<OrderedClaim> {
        let share = self.shares.current();
        // A share's rows are about 1 in `count` of those walked.
        let share_count = share.map_or(1, |s| i64::from(s.count));
        let scan_window = limit
            .saturating_mul(SCAN_WINDOW)
            .saturating_mul(share_count);
        let expired_holds = (limit / i64::from(sql::RELEASED_RUN)).max(1);
        let (from, observe) = self.walk_start.plan(Instant::now());
        if observe {
            self.observe_front(tx, from).await?;
        }
        // Read again: the observation may just have moved the start.
        let walk_start = self.walk_start.from();
        let walked = sqlx::query(&self.sql().claim_aggregates)
            .bind(limit)
            .bind(scan_window)
            .bind(expired_holds)
            .bind(walk_start)
            .bind(share.map(|s| s.index))
            .bind(share.map(|s| s.count))
            .persistent(self.outbox.persistent())
            .fetch_all(&mut *tx)
            .await?;
        if walked.is_empty() {
            self.shares.claimed(false);
            return Ok(OrderedClaim::empty(walk_start));
        }
        let mut released = LockedAggregates::default();
        let mut released_from: Vec<i64> = Vec::new();
        let mut kept = Vec::with_capacity(walked.len());
        let mut skipped_from = None;
        for row in &walked {
            if row::get::<bool>(row, walked::HELD)? {
                released.push(
                    row::get(row, column::AGGREGATE_TYPE)?,
                    row::get(row, column::AGGREGATE_ID)?,
                );
                // An expired hold's row carries its `from_seq` in `seq`.
                released_from.push(row::get::<Option<i64>>(row, column::SEQ)?.unwrap_or(i64::MIN));
                continue;
            }
            if let Some(skipped) = row::get::<Option<i64>>(row, walked::SKIPPED_FROM)? {
                skipped_from = Some(skipped);
                continue;
            }
            kept.push(KeptRow {
                clean: row::get(row, walked::CLEAN)?,
                skipped_before: row::get::<Option<bool>>(row, walked::SKIPPED_BEFORE)?
                    == Some(true),
                row: RunRow::walked(row)?,
            });
        }
        // How far past the start the walk found its first row of this share.
        let first = kept
            .iter()
            .map(|k| k.row.event.seq)
            .chain(skipped_from)
            .min();
        if let Some(first) = first {
            self.walk_start
                .walked(walk_start, first, limit.saturating_mul(share_count));
        }
        let mut window = LockedAggregates::default();
        let read_again: Vec<bool> = {
            let stale = stale_aggregates(&kept);
            if !stale.is_empty() {
                // From the first row kept or the first failed lock, to the last row kept.
                let seqs = || kept.iter().map(|k| k.row.event.seq);
                window.from_seq = seqs().chain(skipped_from).min();
                window.to_seq = seqs().max();
                // One entry per aggregate: `stale` is a set.
                for (aggregate_type, aggregate_id) in &stale {
                    window.push(aggregate_type.to_string(), aggregate_id.to_string());
                }
            }
            kept.iter()
                .map(|k| stale.contains(&k.aggregate()))
                .collect()
        };
        let mut rows: Vec<RunRow> = kept
            .into_iter()
            .zip(read_again)
            .filter(|(_, again)| !again)
            .map(|(k, _)| k.row)
            .collect();
        // Expired holds share the batch: each is read up to `run_len` events (a hot
        // aggregate taken up alone moves a batch at a time).
        let released_count = i64::try_from(released.types.len())
            .unwrap_or(i64::MAX)
            .max(1);
        let run_len = (limit / released_count).max(i64::from(sql::RELEASED_RUN));
        let mut taken_up: HashMap<(String, String), TakenUp> = HashMap::new();
        if !window.types.is_empty() || !released.types.is_empty() {
            let again = sqlx::query(&self.sql().claim_runs)
                .bind(&window.types)
                .bind(&window.ids)
                .bind(window.from_seq)
                .bind(window.to_seq)
                .bind(&released.types)
                .bind(&released.ids)
                .bind(&released_from)
                .bind(run_len)
                .persistent(self.outbox.persistent())
                .fetch_all(&mut *tx)
                .await?;
            for key in released
                .types
                .iter()
                .cloned()
                .zip(released.ids.iter().cloned())
            {
                taken_up.insert(key, TakenUp::default());
            }
            for row in &again {
                let row = RunRow::read_again(row)?;
                if let Some(taken) = taken_up.get_mut(&row.key()) {
                    taken.read += 1;
                    taken.last_read = taken.last_read.max(Some(row.event.seq));
                }
                rows.push(row);
            }
        }
        let runs = Runs::cut(rows, self.config.after_dead_letter, walk_start);

        // Holds: aggregates whose oldest event waits.
        if !runs.holds.is_empty() {
            let t: Vec<&str> = runs.holds.iter().map(|h| h.key.0.as_str()).collect();
            let i: Vec<&str> = runs.holds.iter().map(|h| h.key.1.as_str()).collect();
            let u: Vec<Option<DateTime<Utc>>> = runs.holds.iter().map(|h| h.until).collect();
            let f: Vec<i64> = runs.holds.iter().map(|h| h.from_seq).collect();
            sqlx::query(&self.sql().hold)
                .bind(&t)
                .bind(&i)
                .bind(&u)
                .bind(&f)
                .persistent(self.outbox.persistent())
                .execute(&mut *tx)
                .await?;
        }
        // Expired holds taken up: those held again are done; the others wait for
        // the outcome of their events, unless they have none in this claim.
        for hold in &runs.holds {
            taken_up.remove(&hold.key);
        }
        for (key, seq) in &runs.cut_at {
            if let Some(taken) = taken_up.get_mut(key) {
                taken.cut_at = Some(*seq);
            }
        }
        let with_events: HashSet<(&str, &str)> = runs
            .events
            .iter()
            .map(|e| (e.aggregate_type.as_str(), e.aggregate_id.as_str()))
            .collect();
        let (now, later): (Vec<_>, Vec<_>) = taken_up
            .into_iter()
            .partition(|(key, _)| !with_events.contains(&(key.0.as_str(), key.1.as_str())));
        let mut settled = HeldUpdates::default();
        for (key, taken) in now {
            settled.settle(key, &taken, run_len, walk_start, None);
        }
        settled
            .write(tx, self.sql(), self.outbox.persistent())
            .await?;

        let mut events = runs.events;
        events.sort_by_key(|e| e.seq);
        // At least half full: a backlog goes on (failed and held rows make
        // claims of a backlog come back a little short).
        let claimed = i64::try_from(events.len()).unwrap_or(i64::MAX);
        self.shares.claimed(claimed.saturating_mul(2) >= limit);
        Ok(OrderedClaim {
            events,
            walk_start,
            taken_up: later
                .into_iter()
                .map(|(key, taken)| (key, taken, run_len))
                .collect(),
        })
    }
}

/// Aggregates locked by step 1 of an ordered claim, as step 2 binds them.
#[derive(Default)]
struct LockedAggregates {
    types: Vec<String>,
    ids: Vec<String>,
    /// Window aggregates: the range of the pending index to read.
    from_seq: Option<i64>,
    to_seq: Option<i64>,
}

impl LockedAggregates {
    fn push(&mut self, aggregate_type: String, aggregate_id: String) {
        self.types.push(aggregate_type);
        self.ids.push(aggregate_id);
    }
}

/// A row the ordered walk kept, with the traces of what may have changed it.
struct KeptRow {
    row: RunRow,
    /// No other transaction touched the row (no `xmax`).
    clean: bool,
    /// A row of the same aggregate lies between the walk's first failed lock and
    /// this row (`skipped_before` of `sql::claim_aggregates`).
    skipped_before: bool,
}

impl KeptRow {
    fn aggregate(&self) -> (&str, &str) {
        (&self.row.event.aggregate_type, &self.row.event.aggregate_id)
    }
}

/// The aggregates whose rows, as the walk read them, may not be what their lock now
/// protects, to be read again with a snapshot taken after the locks: a kept row
/// another transaction touched, or an aggregate whose first kept row had a row of
/// its own before it, after the walk's first failed lock. That row was not kept,
/// so its lock failed: the aggregate's holder let go during the walk and may have
/// left it in any state (a published run, a hold, an earlier row still pending).
/// Every other aggregate was free for the whole walk: its rows are used as read.
fn stale_aggregates(kept: &[KeptRow]) -> HashSet<(&str, &str)> {
    // Per aggregate: its first kept row's `seq` and trace.
    let mut first: HashMap<(&str, &str), (i64, bool)> = HashMap::new();
    let mut stale = HashSet::new();
    for k in kept {
        let key = k.aggregate();
        let seq = k.row.event.seq;
        if !k.clean {
            stale.insert(key);
        }
        let entry = first.entry(key).or_insert((seq, k.skipped_before));
        if seq < entry.0 {
            *entry = (seq, k.skipped_before);
        }
    }
    stale.extend(
        first
            .into_iter()
            .filter(|(_, (_, skipped_before))| *skipped_before)
            .map(|(key, _)| key),
    );
    stale
}

/// Rows of the pending index an ordered claim walks per event it may take: room to
/// step over the aggregates other relays hold (8 relays with full batches) while
/// bounding what a claim that finds nothing costs.
const SCAN_WINDOW: i64 = 8;

/// What an ordered claim took: its events, the walk start it used, and the expired
/// holds it took up whose fate depends on how their events fare.
pub(super) struct OrderedClaim {
    pub(super) events: Vec<Event>,
    pub(super) walk_start: i64,
    pub(super) taken_up: Vec<((String, String), TakenUp, i64)>,
}

impl OrderedClaim {
    fn empty(walk_start: i64) -> Self {
        Self {
            events: Vec::new(),
            walk_start,
            taken_up: Vec::new(),
        }
    }
}

/// An aggregate an ordered claim took up from an expired hold: how much of it the
/// claim read (up to the run length it asked for).
#[derive(Debug, Default)]
pub(super) struct TakenUp {
    read: i64,
    last_read: Option<i64>,
    /// The run stopped at this event (not due, or a blocking dead letter) after
    /// taking others.
    cut_at: Option<i64>,
}

/// Expired holds taken up, lifted or kept (migration 7). A hold is lifted only when
/// the claim read all of its aggregate's pending events and published them all:
/// its events may lie below where walks start, so while any is left the hold
/// stays, expired, and its `from_seq` moves up to the first event not published
/// (never above the walk start: a producer that commits late numbers its event
/// above it).
#[derive(Default)]
pub(super) struct HeldUpdates {
    lift_types: Vec<String>,
    lift_ids: Vec<String>,
    advance_types: Vec<String>,
    advance_ids: Vec<String>,
    advance_from: Vec<i64>,
}

impl HeldUpdates {
    /// What becomes of the hold of `key`, taken up as `taken` (asking for
    /// `run_len` events), whose first event in the claim that was not published
    /// is `first_unpublished` (`None`: all were, or it had none).
    pub(super) fn settle(
        &mut self,
        key: (String, String),
        taken: &TakenUp,
        run_len: i64,
        walk_start: i64,
        first_unpublished: Option<i64>,
    ) {
        let complete = taken.read < run_len && taken.cut_at.is_none();
        if complete && first_unpublished.is_none() {
            self.lift_types.push(key.0);
            self.lift_ids.push(key.1);
            return;
        }
        let next = taken
            .cut_at
            .or_else(|| taken.last_read.map(|seq| seq.saturating_add(1)));
        let from = first_unpublished
            .or(next)
            .map_or(walk_start, |seq| seq.min(walk_start));
        self.advance_types.push(key.0);
        self.advance_ids.push(key.1);
        self.advance_from.push(from);
    }

    pub(super) async fn write(
        self,
        conn: &mut PgConnection,
        sql: &Sql,
        persistent: bool,
    ) -> Result<()> {
        if !self.lift_types.is_empty() {
            sqlx::query(&sql.unhold)
                .bind(&self.lift_types)
                .bind(&self.lift_ids)
                .persistent(persistent)
                .execute(&mut *conn)
                .await?;
        }
        if !self.advance_types.is_empty() {
            sqlx::query(&sql.advance_held)
                .bind(&self.advance_types)
                .bind(&self.advance_ids)
                .bind(&self.advance_from)
                .persistent(persistent)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}

/// The runs read by an ordered claim, cut where they must stop.
struct Runs {
    events: Vec<Event>,
    holds: Vec<Hold>,
    /// Aggregates whose run stopped after taking events, at this event.
    cut_at: Vec<((String, String), i64)>,
}

/// An aggregate to hold: its oldest event is not due before `until` (`None`: a
/// blocking dead letter, looked at again after a recheck interval), and every
/// pending event of it is at or after `from_seq`.
struct Hold {
    key: (String, String),
    until: Option<DateTime<Utc>>,
    from_seq: i64,
}

impl Runs {
    /// Cut each aggregate's rows (sorted here by aggregate, then seq) before the
    /// first row that is not due, or, with [`AfterDeadLetter::Block`],
    /// the first dead letter; with `Release`, dead letters are stepped over. An
    /// aggregate whose very first row stops it is held, from that row or the
    /// claim's `walk_start` if lower (a producer that commits late numbers its
    /// event at or above the walk start).
    fn cut(mut rows: Vec<RunRow>, after_dead_letter: AfterDeadLetter, walk_start: i64) -> Self {
        if rows
            .iter()
            .all(|row| row.waits_until.is_none() && !row.dead)
        {
            // Nothing stops a run (the usual claim): every row is taken, and the
            // sort by aggregate below would only cost time.
            return Self {
                events: rows.into_iter().map(|row| row.event).collect(),
                holds: Vec::new(),
                cut_at: Vec::new(),
            };
        }
        rows.sort_by(|a, b| {
            (&a.event.aggregate_type, &a.event.aggregate_id, a.event.seq).cmp(&(
                &b.event.aggregate_type,
                &b.event.aggregate_id,
                b.event.seq,
            ))
        });
        let mut events = Vec::with_capacity(rows.len());
        let mut holds = Vec::new();
        let mut cut_at = Vec::new();
        let mut current: Option<(String, String)> = None;
        let mut taken = 0usize;
        let mut stopped = false;
        for row in rows {
            let same = current.as_ref().is_some_and(|(t, i)| {
                *t == row.event.aggregate_type && *i == row.event.aggregate_id
            });
            if !same {
                current = Some((
                    row.event.aggregate_type.clone(),
                    row.event.aggregate_id.clone(),
                ));
                taken = 0;
                stopped = false;
            }
            if stopped {
                continue;
            }
            let stop = if row.dead {
                match after_dead_letter {
                    AfterDeadLetter::Release => continue,
                    AfterDeadLetter::Block => Some(None),
                }
            } else {
                // Not due: stop, held until then.
                row.waits_until.map(Some)
            };
            match stop {
                Some(until) => {
                    stopped = true;
                    let seq = row.event.seq;
                    let key = (row.event.aggregate_type, row.event.aggregate_id);
                    if taken == 0 {
                        let from_seq = seq.min(walk_start);
                        holds.push(Hold {
                            key,
                            until,
                            from_seq,
                        });
                    } else {
                        cut_at.push((key, seq));
                    }
                }
                None => {
                    taken += 1;
                    events.push(row.event);
                }
            }
        }
        Self {
            events,
            holds,
            cut_at,
        }
    }
}

/// One row of a run, from either step of the ordered claim.
struct RunRow {
    event: Event,
    /// When the event becomes due; `None`: it is due.
    waits_until: Option<DateTime<Utc>>,
    dead: bool,
}

impl RunRow {
    /// A row of step 1 (the pending index holds no dead letters).
    fn walked(row: &PgRow) -> Result<Self> {
        Ok(Self {
            event: row::event(row)?,
            waits_until: row::get(row, walked::WAITS_UNTIL)?,
            dead: false,
        })
    }

    fn key(&self) -> (String, String) {
        (
            self.event.aggregate_type.clone(),
            self.event.aggregate_id.clone(),
        )
    }

    /// A row of step 2.
    fn read_again(row: &PgRow) -> Result<Self> {
        Ok(Self {
            event: row::event(row)?,
            waits_until: row::get(row, read_again::WAITS_UNTIL)?,
            dead: row::get(row, read_again::DEAD)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgoutbox_core::conformance::claimed_event;

    fn kept(aggregate: &str, seq: i64, clean: bool, skipped_before: bool) -> KeptRow {
        KeptRow {
            row: RunRow {
                event: claimed_event("order", aggregate, "order.updated", seq),
                waits_until: None,
                dead: false,
            },
            clean,
            skipped_before,
        }
    }

    fn sorted<'a>(stale: HashSet<(&'a str, &'a str)>) -> Vec<&'a str> {
        let mut ids: Vec<&str> = stale.into_iter().map(|(_, id)| id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn aggregates_without_a_trace_are_used_as_read() {
        let rows = [
            kept("a", 1, true, false),
            kept("b", 2, true, false),
            kept("a", 3, true, false),
        ];
        assert!(stale_aggregates(&rows).is_empty());
    }

    #[test]
    fn a_row_someone_touched_makes_its_aggregate_stale() {
        let rows = [
            kept("a", 1, true, false),
            kept("b", 2, true, false),
            kept("a", 3, false, false),
        ];
        assert_eq!(sorted(stale_aggregates(&rows)), ["a"]);
    }

    #[test]
    fn a_row_skipped_before_the_first_kept_row_makes_its_aggregate_stale() {
        // `b` had a row whose lock failed before its first kept row; `a`'s later
        // rows find `a`'s own earlier kept row, which says nothing.
        let rows = [
            kept("a", 1, true, false),
            kept("b", 5, true, true),
            kept("a", 6, true, true),
            kept("b", 7, true, true),
        ];
        assert_eq!(sorted(stale_aggregates(&rows)), ["b"]);
    }

    #[test]
    fn the_first_kept_row_is_the_lowest_seq_in_any_order() {
        let rows = [kept("a", 9, true, true), kept("a", 4, true, false)];
        assert!(stale_aggregates(&rows).is_empty());
        let rows = [kept("a", 9, true, false), kept("a", 4, true, true)];
        assert_eq!(sorted(stale_aggregates(&rows)), ["a"]);
    }
}
