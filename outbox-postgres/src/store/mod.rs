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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutbox_core::{Claim, Decision, Event, Store, StoreError};
use sqlx::{PgConnection, PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::enqueue::Outbox;
use crate::error::{Error, Result};
use crate::pooler::caches_statements;
use crate::row;
use crate::shares::{self, Membership, Shares};
use crate::sql::{self, AfterDeadLetter, Sql};
use crate::tables::Tables;
use crate::wakeup::{Probe, Waker, Wakeup};
use crate::walk_start::{Observation, WalkStart};

mod ordered_claim;

use ordered_claim::{HeldUpdates, TakenUp};

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
    /// flush per batch (one fsync per batch; what the drain gains is in
    /// `docs/benchmarks-history.md`).
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
        let outbox = Outbox::new(tables).with_unnamed_statements(!caches_statements(&pool));
        let waker = Arc::new(Waker::new(Wakeup::default(), outbox.sql()));
        Self {
            pool,
            outbox,
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
        self.waker = Arc::new(Waker::new(wakeup, self.outbox.sql()));
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
        self.outbox.sql()
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
        self.restore_walk_start_when_due().await;
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

    /// Where statements that count pending events start walking the pending
    /// index: the walk start, read from where relays saved it first if due.
    pub(crate) async fn counting_walk_start(&self) -> i64 {
        self.restore_walk_start_when_due().await;
        self.walk_start.from()
    }

    /// Read the walk start relays saved (`walk_start.rs`, migration 9), once, before
    /// the first statement that walks the pending index from the start: the first
    /// claim, count or wake-up probe, whichever comes first (a relay counts its
    /// pending events as it starts, beside its first claim). Without it the relay
    /// walks from the beginning until its own observations move its start on, as
    /// relays of earlier versions did: under a held snapshot, over every entry of an
    /// event published since the snapshot was taken.
    async fn restore_walk_start_when_due(&self) {
        if !self.walk_start.restore_due() {
            return;
        }
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
        let row = sqlx::raw_sql(&Sql::guarded(statement, self.counting_walk_start().await))
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
        self.restore_walk_start_when_due().await;
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
