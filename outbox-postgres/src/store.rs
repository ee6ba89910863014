//! [`PgStore`]: the relay's view of the outbox table.
//!
//! A claim is a transaction: it locks the batch, the relay publishes, then the
//! outcomes are written with set-based statements and the transaction commits. If
//! the relay dies at any point before the commit, its connection closes, PostgreSQL
//! rolls back, and the rows are claimable again at once: at least once, never lost.
//!
//! With per-aggregate ordering on (the default) a claim takes *runs*: in two
//! statements, it first locks aggregates (transaction-scoped advisory locks, one per
//! aggregate, tried while walking the oldest pending events), then reads each locked
//! aggregate's events in insertion order with a snapshot taken after the locks.
//! Relays skip each other's aggregates, a claim costs the same whatever the key
//! distribution or the backlog, and an aggregate whose oldest event is not due is
//! held (a row in the holds table) until it is, so its followers cost nothing.
//! Without ordering, `SELECT ... FOR UPDATE SKIP LOCKED` takes any due events.
//!
//! Claiming and recording use no session state (transaction-scoped locks and
//! settings only, no LISTEN), so they work through a transaction-pooling proxy; only
//! the opt-in [`Wakeup::Notify`] needs a direct session for its listener.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use pgoutbox_core::{Claim, Decision, Event, Store, StoreError};
use sqlx::postgres::PgConnectOptions;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::enqueue::Outbox;
use crate::error::{Error, Result};
use crate::pooler::caches_statements;
use crate::row::{self, column, column::read_again, column::walked};
use crate::shares::{self, Membership, Shares};
use crate::sql::{self, AfterDeadLetter, Sql};
use crate::tables::Tables;
use crate::wakeup::{Probe, Waker, Wakeup};
use crate::walk_start::{Observation, WalkStart};

/// What happens to an event once it is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retention {
    /// Delete the row at once: the fastest drain and a small table. The default.
    #[default]
    Delete,
    /// Keep the row with `processed_at` set; [`crate::Cleanup`] deletes rows older
    /// than the given age in bounded batches.
    Keep(Duration),
}

/// How the store claims and records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Publish the events of one aggregate in insertion order. Defaults to `true`.
    ///
    /// With ordering on, a claim takes runs: for each aggregate it locks, the oldest
    /// unpublished events in insertion order, up to the first one not due. No other
    /// relay claims an aggregate while a claim holds it, and a failing or
    /// backing-off event holds back its own aggregate only. With ordering off, any
    /// due event can be claimed: maximum parallelism, no order between relays. All
    /// relays of one outbox must use the same setting.
    pub ordering: bool,
    /// Followers of a dead-lettered event, when ordering is on. Defaults to
    /// [`AfterDeadLetter::Block`].
    pub after_dead_letter: AfterDeadLetter,
    /// Delete or keep published rows. Defaults to [`Retention::Delete`].
    pub retention: Retention,
    /// Whether committing a batch's outcomes waits for the WAL flush. Defaults to
    /// `true` (the server's setting). With `false` the claim transaction runs
    /// `SET LOCAL synchronous_commit = off` (in the same round trip as `BEGIN`;
    /// transaction-scoped, so pooler-safe) and the relay does not wait for a WAL
    /// flush per batch (an fsync takes about 3 ms on our machine; the drain gained
    /// 7% in `docs/benchmarks-history.md`).
    /// The cost: if PostgreSQL itself crashes, outcomes recorded in the last moments
    /// before the crash (at most 3 x `wal_writer_delay`) are undone, and those events
    /// are published again. Duplicates around a crash, never a loss: producers'
    /// transactions keep their own setting.
    pub synchronous_commit: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            ordering: true,
            after_dead_letter: AfterDeadLetter::Block,
            retention: Retention::Delete,
            synchronous_commit: true,
        }
    }
}

/// Builder-style setters: the struct is `#[non_exhaustive]` (fields may be added),
/// so outside this crate it is built from [`StoreConfig::default`] with these (or by
/// assigning its public fields), not with a struct expression.
impl StoreConfig {
    /// Set [`StoreConfig::ordering`].
    #[must_use]
    pub fn ordering(mut self, value: bool) -> Self {
        self.ordering = value;
        self
    }

    /// Set [`StoreConfig::after_dead_letter`].
    #[must_use]
    pub fn after_dead_letter(mut self, value: AfterDeadLetter) -> Self {
        self.after_dead_letter = value;
        self
    }

    /// Set [`StoreConfig::retention`].
    #[must_use]
    pub fn retention(mut self, value: Retention) -> Self {
        self.retention = value;
        self
    }

    /// Set [`StoreConfig::synchronous_commit`].
    #[must_use]
    pub fn synchronous_commit(mut self, value: bool) -> Self {
        self.synchronous_commit = value;
        self
    }
}

/// The PostgreSQL outbox as a relay [`Store`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    outbox: Outbox,
    /// The statements of the claim path, the wake-up and the statistics.
    sql: Arc<Sql>,
    config: StoreConfig,
    waker: Arc<Waker>,
    walk_start: Arc<WalkStart>,
    shares: Arc<Shares>,
}

impl PgStore {
    /// A store on `pool` for the outbox in `tables`, with the default [`StoreConfig`].
    ///
    /// On a pool without a statement cache ([`crate::pooler_options`]) its
    /// statements are unnamed, and so are those of its [`PgStore::outbox`].
    pub fn new(pool: PgPool, tables: Tables) -> Self {
        let sql = Arc::new(Sql::new(&tables));
        let outbox = Outbox::new(tables).with_unnamed_statements(!caches_statements(&pool));
        let waker = Arc::new(Waker::new(Wakeup::default(), &sql));
        Self {
            pool,
            outbox,
            sql,
            config: StoreConfig::default(),
            waker,
            walk_start: Arc::new(WalkStart::new(Instant::now())),
            shares: Arc::new(Shares::new()),
        }
    }

    /// The same store (pool, outbox, configuration, wake-up) for another relay in
    /// this process: a relay of its own for the other relays, with its own share
    /// of a backlog and its own walk start, as a relay in another process has.
    /// A clone is the same relay (its workers share one share).
    #[must_use]
    pub fn another_relay(&self) -> Self {
        Self {
            walk_start: Arc::new(WalkStart::new(Instant::now())),
            shares: Arc::new(Shares::new()),
            ..self.clone()
        }
    }

    /// Wait for new events this way when the outbox is empty. Defaults to
    /// [`Wakeup::adaptive`]; [`Wakeup::Notify`] needs [`crate::install_notify_trigger`]
    /// and, without its own URL, one connection of the pool for as long as the store lives.
    #[must_use]
    pub fn with_wakeup(mut self, wakeup: Wakeup) -> Self {
        self.waker = Arc::new(Waker::new(wakeup, &self.sql));
        self
    }

    /// The wake-up mode in use.
    pub fn wakeup(&self) -> &Wakeup {
        self.waker.mode()
    }

    /// Use this configuration.
    #[must_use]
    pub fn with_config(mut self, config: StoreConfig) -> Self {
        self.config = config;
        self
    }

    /// Connect a pool suited to a relay ([`crate::relay_pool_options`]):
    /// `max_connections` connections, each with the session settings of
    /// [`crate::relay_connect_options`], so that a relay cut off by the network
    /// cannot hold its claimed rows for longer than `claim_timeout`.
    pub async fn connect(
        url: &str,
        max_connections: u32,
        claim_timeout: Duration,
    ) -> Result<PgPool> {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e: sqlx::Error| Error::InvalidConfig(format!("database URL: {e}")))?;
        Ok(
            crate::relay_pool_options(max_connections, Duration::from_secs(10))
                .connect_with(crate::relay_connect_options(options, claim_timeout))
                .await?,
        )
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox writer for the same tables.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// The configuration in use.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    pub(crate) fn sql(&self) -> &Arc<Sql> {
        &self.sql
    }

    /// The statements of this configuration's claim and record, for benchmarks that
    /// measure the same SQL work without the relay. Not a stable API.
    #[cfg(feature = "unstable-internals")]
    pub fn claim_and_record_sql(&self) -> ClaimSql<'_> {
        let sql = self.sql();
        let record = match self.config.retention {
            Retention::Delete => &sql.delete_published,
            Retention::Keep(_) => &sql.mark_published,
        };
        ClaimSql {
            begin: self.begin_statement(),
            ordered: self.config.ordering,
            claim_unordered: &sql.claim_unordered,
            record,
        }
    }

    fn begin_statement(&self) -> &'static str {
        if self.config.synchronous_commit {
            sql::BEGIN
        } else {
            sql::BEGIN_ASYNC_COMMIT
        }
    }

    async fn claim_batch(&self, limit: usize) -> Result<PgClaim> {
        let limit = i64::try_from(limit)
            .map_err(|_| Error::InvalidConfig("batch size too large".into()))?;
        if self.config.ordering {
            self.keep_share().await;
        }
        if self.walk_start.restore_due() {
            self.restore_walk_start().await;
        }
        self.save_walk_start_when_due();
        self.look_below_when_due();
        let mut tx = self.pool.begin_with(self.begin_statement()).await?;
        self.waker.claiming();
        let (events, walk_start, taken_up) = if self.config.ordering {
            let runs = self.claim_runs(&mut tx, limit).await?;
            (runs.events, runs.walk_start, runs.taken_up)
        } else {
            let (from, observe) = self.walk_start.plan(Instant::now());
            if observe {
                self.observe_front(&mut tx, from).await?;
            }
            let from = self.walk_start.from();
            let rows = sqlx::query(&self.sql().claim_unordered)
                .bind(limit)
                .bind(from)
                .persistent(self.outbox.persistent())
                .fetch_all(&mut *tx)
                .await?;
            let events = rows
                .iter()
                .map(row::event)
                .collect::<Result<Vec<Event>, _>>()?;
            (events, from, Vec::new())
        };
        self.waker.claimed(events.len());
        let tx = if events.is_empty() {
            // Holds written while claiming must stay.
            tx.commit().await?;
            None
        } else {
            Some(tx)
        };
        Ok(PgClaim {
            tx,
            events,
            walk_start,
            taken_up,
            sql: Arc::clone(self.sql()),
            config: self.config,
            persistent: self.outbox.persistent(),
        })
    }

    /// Read the walk start relays saved (`walk_start.rs`, migration 9), once before
    /// the first claim. Without it the relay walks from the beginning until its own
    /// observations move its start on, as relays of earlier versions did.
    async fn restore_walk_start(&self) {
        let load = self.sql().walk_start_load(self.config.ordering);
        let saved = sqlx::raw_sql(&load)
            .fetch_all(&self.pool)
            .await
            .and_then(|rows| rows.first().map(|row| row.try_get::<i64, _>(0)).transpose());
        let saved = match saved {
            Ok(saved) => saved,
            Err(error) => {
                tracing::warn!(
                    outbox = %self.name(),
                    %error,
                    "could not read the saved walk start (migration 9 applied?): \
                     walking the pending index from its beginning until this relay's \
                     own start moves on"
                );
                None
            }
        };
        self.walk_start.restored(saved);
    }

    /// Save the walk start for relays that start later, off the claim path, when a
    /// save is due (`walk_start.rs`). A failure only costs a later relay its head
    /// start: logged, tried again after the interval.
    fn save_walk_start_when_due(&self) {
        let Some(from) = self.walk_start.save_due(Instant::now()) else {
            return;
        };
        let store = self.clone();
        tokio::spawn(async move {
            let save = store.sql().walk_start_save(store.config.ordering, from);
            let saved = sqlx::raw_sql(&save).execute(&store.pool).await;
            if let Err(error) = &saved {
                tracing::debug!(outbox = %store.name(), %error, "could not save the walk start");
            }
            store
                .walk_start
                .save_ended(saved.ok().map(|_| from), Instant::now());
        });
    }

    /// Start a look below the walk start, off the claim path, when one is due
    /// (`walk_start.rs`): a pending event that no hold accounts for (put back by
    /// hand in SQL) takes the start back to it.
    fn look_below_when_due(&self) {
        let Some(from) = self.walk_start.look_below_due(Instant::now()) else {
            return;
        };
        let store = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let found = store.look_below(from).await;
            let completed = Instant::now();
            let found = match found {
                Ok(found) => found,
                Err(error) => {
                    tracing::debug!(outbox = %store.name(), %error, "look below the walk start failed");
                    None
                }
            };
            if let Some(seq) = found {
                tracing::info!(
                    outbox = %store.name(),
                    seq,
                    walk_start = from,
                    "a pending event below the walk start that no hold accounts for \
                     (changed by hand?): walking from it"
                );
            }
            store.walk_start.looked_below(found, started, completed);
        });
    }

    /// The oldest pending event below `from` that no hold accounts for.
    async fn look_below(&self, from: i64) -> Result<Option<i64>> {
        let statement = if self.config.ordering {
            &self.sql().look_below_ordered
        } else {
            &self.sql().look_below_unordered
        };
        let rows = sqlx::raw_sql(&Sql::guarded(statement, from))
            .fetch_all(&self.pool)
            .await?;
        Ok(match rows.first() {
            Some(row) => Some(row.try_get(0)?),
            None => None,
        })
    }

    /// The ordered claim's statements, run in the caller's transaction on `conn`
    /// (opened with [`ClaimSql::begin`]), for benchmarks that measure the same SQL
    /// work without the relay. Not a stable API.
    #[cfg(feature = "unstable-internals")]
    pub async fn claim_ordered_on(
        &self,
        conn: &mut PgConnection,
        limit: i64,
    ) -> Result<Vec<Event>> {
        self.keep_share().await;
        Ok(self.claim_runs(conn, limit).await?.events)
    }

    /// Renew this relay's row in the relays table, or delete it, when due
    /// (`shares.rs`). A failure costs only the share: it is logged and the claim
    /// goes on without one.
    async fn keep_share(&self) {
        let Some(step) = self.shares.due(Instant::now()) else {
            return;
        };
        let outbox = self.outbox.tables().qualify(self.outbox.tables().events());
        match step {
            Membership::Renew => {
                let expiry_ms = u64::try_from(shares::EXPIRY.as_millis()).unwrap_or(u64::MAX);
                let renew = self.sql().share_renew(self.shares.relay(), expiry_ms);
                let seen = sqlx::raw_sql(&renew)
                    .fetch_all(&self.pool)
                    .await
                    .and_then(|rows| {
                        rows.iter()
                            .map(|row| row.try_get::<Uuid, _>(0))
                            .collect::<Result<Vec<_>, _>>()
                    });
                match seen {
                    Ok(others) => {
                        if let Some(share) = self.shares.renewed(&others, Instant::now()) {
                            tracing::debug!(
                                outbox,
                                share = ?share.map(|s| (s.index, s.count)),
                                "this relay's share of the backlog (index, relays)"
                            );
                        }
                    }
                    Err(error) => {
                        if self.shares.renew_failed(Instant::now()) {
                            tracing::warn!(
                                outbox,
                                error = %error,
                                "could not record this relay in the relays table (migration 6); \
                                 claiming the backlog without a share"
                            );
                        } else {
                            tracing::debug!(outbox, error = %error, "relays table still failing");
                        }
                    }
                }
            }
            Membership::Leave => {
                let leave = self.sql().share_leave(self.shares.relay());
                let left = sqlx::raw_sql(&leave).execute(&self.pool).await;
                if let Err(error) = left {
                    // The row expires on its own.
                    tracing::debug!(outbox, error = %error, "could not delete this relay's row");
                }
                self.shares.left();
            }
        }
    }

    /// The ordered claim: lock aggregates while reading their runs, and read them
    /// again if something may have changed them meanwhile (see `sql::claim_aggregates`).
    async fn claim_runs(&self, tx: &mut PgConnection, limit: i64) -> Result<OrderedClaim> {
        let share = self.shares.current();
        // A share's rows are about 1 in `count` of those walked.
        let scan_window = limit
            .saturating_mul(SCAN_WINDOW)
            .saturating_mul(share.map_or(1, |s| i64::from(s.count)));
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

impl PgStore {
    /// Look at the front of the pending index and at the running producers,
    /// which may move the walk start (see `walk_start.rs`).
    async fn observe_front(&self, tx: &mut PgConnection, from: i64) -> Result<()> {
        let statement = if self.config.ordering {
            &self.sql().walk_front_ordered
        } else {
            &self.sql().walk_front_unordered
        };
        let started = Instant::now();
        let row = sqlx::query(statement)
            .bind(from)
            .persistent(self.outbox.persistent())
            .fetch_one(&mut *tx)
            .await?;
        let completed = Instant::now();
        if row.try_get::<bool, _>("expired_holds")? {
            // Unordered: dead letters retried below the start; walk from the
            // beginning once (the holds go with this claim's transaction).
            self.walk_start.go_back(i64::MIN, completed);
            sqlx::query(&self.sql().drop_expired_holds)
                .persistent(self.outbox.persistent())
                .execute(&mut *tx)
                .await?;
            return Ok(());
        }
        self.walk_start.observed(Observation {
            front: row.try_get("front")?,
            running: row.try_get("running")?,
            started,
            completed,
        });
        Ok(())
    }

    async fn count_pending(&self) -> Result<u64> {
        let statement = if self.config.ordering {
            &self.sql().count_pending_ordered
        } else {
            &self.sql().count_pending_unordered
        };
        let row = sqlx::raw_sql(&Sql::guarded(statement, self.walk_start.from()))
            .fetch_one(&self.pool)
            .await?;
        let n: i64 = row.try_get(0)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// This relay's share of a backlog for its next ordered claim, as (index,
    /// count); none while claims are not full or it is the only relay
    /// (`shares.rs`): what the `outbox` binary's console shows.
    pub fn share(&self) -> Option<(i32, i32)> {
        self.shares.current().map(|s| (s.index, s.count))
    }

    /// The `seq` ordered claims start walking the pending index at: below it, every
    /// event is published or dead-lettered. For tests and benchmarks; not a stable API.
    #[cfg(feature = "unstable-internals")]
    pub fn walk_start(&self) -> i64 {
        self.walk_start.from()
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
struct OrderedClaim {
    events: Vec<Event>,
    walk_start: i64,
    taken_up: Vec<((String, String), TakenUp, i64)>,
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
struct TakenUp {
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
struct HeldUpdates {
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
    fn settle(
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

    async fn write(self, conn: &mut PgConnection, sql: &Sql, persistent: bool) -> Result<()> {
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

/// The SQL of a claim and its record, for benchmarks (see
/// [`PgStore::claim_and_record_sql`]). Not a stable API.
#[cfg(feature = "unstable-internals")]
#[derive(Debug, Clone, Copy)]
pub struct ClaimSql<'a> {
    /// Opens the claim transaction (simple protocol).
    pub begin: &'static str,
    /// Whether claims are ordered ([`PgStore::claim_ordered_on`]) or not (one
    /// statement, `claim_unordered`).
    pub ordered: bool,
    /// Unordered claim; bind: limit, walk start (`i64::MIN`: the whole index).
    pub claim_unordered: &'a str,
    /// Records published events; bind: `uuid[]`.
    pub record: &'a str,
}

impl Store for PgStore {
    type Claim = PgClaim;

    /// `schema.table` of the events table.
    fn name(&self) -> String {
        self.outbox.tables().outbox_name()
    }

    async fn claim(&self, limit: usize) -> Result<PgClaim, StoreError> {
        Ok(self.claim_batch(limit).await?)
    }

    fn ordered(&self) -> bool {
        self.config.ordering
    }

    /// Pending events: those at or after this relay's walk start, and those of
    /// held aggregates below it, so that counting never reads the index entries
    /// of published events below the start (vacuum may not have removed them).
    async fn pending(&self) -> Result<u64, StoreError> {
        Ok(self.count_pending().await?)
    }

    async fn wait_for_events(&self, timeout: Duration) {
        let probe = Probe {
            sql: self.sql(),
            unnamed: !self.outbox.persistent(),
            ordered: self.config.ordering,
            walk_start: self.walk_start.from(),
        };
        self.waker.wait(&self.pool, probe, timeout).await;
    }

    /// Leave the relays table (`shares.rs`): the other relays take this one's
    /// share at their next renewal. Bounded by the row's expiry, after which
    /// leaving changes nothing; a failure is logged only (the row expires).
    async fn stopped(&self) {
        // No longer draining: the step due is to leave, if the row was written.
        self.shares.claimed(false);
        let _ = tokio::time::timeout(shares::EXPIRY, self.keep_share()).await;
    }
}

/// A batch of locked events. [`Claim::complete`] records the outcomes,
/// [`Claim::release`] gives the events back; dropping it gives them back too, once
/// sqlx has rolled the transaction back (when the connection is next used).
#[derive(Debug)]
pub struct PgClaim {
    tx: Option<Transaction<'static, Postgres>>,
    events: Vec<Event>,
    /// The walk start the claim used: bound of the holds it writes.
    walk_start: i64,
    /// Expired holds taken up, settled by the outcome of their events.
    taken_up: Vec<((String, String), TakenUp, i64)>,
    sql: Arc<Sql>,
    config: StoreConfig,
    persistent: bool,
}

impl PgClaim {
    async fn record(mut self, decisions: Vec<Decision>) -> Result<()> {
        if decisions.len() != self.events.len() {
            return Err(Error::InvalidConfig(format!(
                "{} decisions for {} claimed events",
                decisions.len(),
                self.events.len()
            )));
        }
        let Some(mut tx) = self.tx.take() else {
            return Ok(());
        };
        let mut published: Vec<Uuid> = Vec::new();
        let mut failed_ids: Vec<Uuid> = Vec::new();
        let mut errors: Vec<String> = Vec::new();
        let mut delays_ms: Vec<f64> = Vec::new();
        let mut dead: Vec<bool> = Vec::new();
        // Of the aggregates taken up from expired holds: failed (their holds are
        // written with the failures), or the first event not published.
        let mut outcomes: HashMap<(&str, &str), (bool, Option<i64>)> = self
            .taken_up
            .iter()
            .map(|(key, _, _)| ((key.0.as_str(), key.1.as_str()), (false, None)))
            .collect();
        for (event, decision) in self.events.iter().zip(decisions) {
            if let Some((failed, first_unpublished)) =
                outcomes.get_mut(&(event.aggregate_type.as_str(), event.aggregate_id.as_str()))
            {
                match &decision {
                    Decision::Published => {}
                    Decision::Retry { .. } | Decision::DeadLetter { .. } => *failed = true,
                    Decision::HeldBack => {
                        *first_unpublished =
                            Some(first_unpublished.map_or(event.seq, |s| s.min(event.seq)));
                    }
                }
            }
            match decision {
                Decision::Published => published.push(event.id),
                Decision::Retry { delay, error } => {
                    failed_ids.push(event.id);
                    errors.push(error);
                    delays_ms.push(delay.as_secs_f64() * 1000.0);
                    dead.push(false);
                }
                Decision::DeadLetter { error } => {
                    failed_ids.push(event.id);
                    errors.push(error);
                    delays_ms.push(0.0);
                    dead.push(true);
                }
                // Nothing is written for it; the commit releases its lock.
                Decision::HeldBack => {}
            }
        }
        if !published.is_empty() {
            let statement = match self.config.retention {
                Retention::Delete => &self.sql.delete_published,
                Retention::Keep(_) => &self.sql.mark_published,
            };
            sqlx::query(statement)
                .bind(&published)
                .persistent(self.persistent)
                .execute(&mut *tx)
                .await?;
        }
        if !failed_ids.is_empty() {
            let statement = self
                .sql
                .record_failures(self.config.ordering, self.config.after_dead_letter);
            let query = sqlx::query(statement)
                .bind(&failed_ids)
                .bind(&errors)
                .bind(&delays_ms)
                .bind(&dead);
            // Ordered: the holds written with the failures start no higher than
            // the claim's walk start.
            let query = if self.config.ordering {
                query.bind(self.walk_start)
            } else {
                query
            };
            query.persistent(self.persistent).execute(&mut *tx).await?;
        }
        let mut settled = HeldUpdates::default();
        for (key, taken, run_len) in &self.taken_up {
            let (failed, first_unpublished) = outcomes
                .get(&(key.0.as_str(), key.1.as_str()))
                .copied()
                .unwrap_or((false, None));
            if !failed {
                settled.settle(
                    key.clone(),
                    taken,
                    *run_len,
                    self.walk_start,
                    first_unpublished,
                );
            }
        }
        settled.write(&mut tx, &self.sql, self.persistent).await?;
        tx.commit().await?;
        Ok(())
    }
}

impl Claim for PgClaim {
    fn events(&self) -> &[Event] {
        &self.events
    }

    async fn complete(self, decisions: Vec<Decision>) -> Result<(), StoreError> {
        Ok(self.record(decisions).await?)
    }

    async fn release(mut self) -> Result<(), StoreError> {
        if let Some(tx) = self.tx.take() {
            tx.rollback().await.map_err(Error::from)?;
        }
        Ok(())
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
