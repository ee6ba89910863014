//! [`PgStore`]: the relay's view of the outbox table.
//!
//! A claim is a transaction: `SELECT ... FOR UPDATE SKIP LOCKED` locks the batch,
//! the relay publishes, then the outcomes are written with set-based statements and
//! the transaction commits. If the relay dies at any point before the commit, its
//! connection closes, PostgreSQL rolls back, and the rows are claimable again at
//! once: at least once, never lost. Claiming and recording use no session state (no
//! session advisory locks, no LISTEN), so they work through a transaction-pooling
//! proxy; only the opt-in [`Wakeup::Notify`] needs a direct session for its listener.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Claim, Decision, Event, Store, StoreError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::enqueue::Outbox;
use crate::error::{Error, Result};
use crate::row;
use crate::sql::{AfterDeadLetter, Sql};
use crate::tables::Tables;
use crate::wakeup::{Waker, Wakeup};

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
pub struct StoreConfig {
    /// Publish the events of one aggregate in insertion order. Defaults to `true`.
    ///
    /// With ordering on, only the oldest unpublished event of each aggregate can be
    /// claimed, so a batch holds at most one event per aggregate and a failing or
    /// backing-off event holds back its own aggregate only. With ordering off, any
    /// due event can be claimed: maximum parallelism, no order between relays.
    pub ordering: bool,
    /// Followers of a dead-lettered event, when ordering is on. Defaults to
    /// [`AfterDeadLetter::Release`].
    pub after_dead_letter: AfterDeadLetter,
    /// Delete or keep published rows. Defaults to [`Retention::Delete`].
    pub retention: Retention,
    /// Whether committing a batch's outcomes waits for the WAL flush. Defaults to
    /// `true` (the server's setting). With `false` the claim transaction runs
    /// `SET LOCAL synchronous_commit = off` (in the same round trip as `BEGIN`;
    /// transaction-scoped, so pooler-safe) and the relay does not wait for a WAL
    /// flush per batch (an fsync takes about 3 ms on our machine; the drain gained
    /// 7% in `BENCHMARKS.md`).
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
            after_dead_letter: AfterDeadLetter::Release,
            retention: Retention::Delete,
            synchronous_commit: true,
        }
    }
}

/// The PostgreSQL outbox as a relay [`Store`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    outbox: Outbox,
    config: StoreConfig,
    waker: Arc<Waker>,
}

impl PgStore {
    /// A store on `pool` for the outbox in `tables`, with the default [`StoreConfig`].
    pub fn new(pool: PgPool, tables: Tables) -> Self {
        let outbox = Outbox::new(tables);
        let waker = Arc::new(Waker::new(Wakeup::default(), outbox.sql()));
        Self {
            pool,
            outbox,
            config: StoreConfig::default(),
            waker,
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

    /// Connect a pool suited to a relay: `max_connections` connections, and an
    /// `idle_in_transaction_session_timeout` on each, so that a relay cut off by the
    /// network cannot hold its claimed rows for longer than `claim_timeout`.
    ///
    /// Connections are not pinged when taken from the pool (one round trip less per
    /// batch); a broken one fails its claim, the relay retries after `error_backoff`
    /// and the pool replaces it.
    pub async fn connect(
        url: &str,
        max_connections: u32,
        claim_timeout: Duration,
    ) -> Result<PgPool> {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e: sqlx::Error| Error::InvalidConfig(format!("database URL: {e}")))?;
        let millis = claim_timeout.as_millis().max(1).to_string();
        let options = options.options([("idle_in_transaction_session_timeout", millis.as_str())]);
        Ok(PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .test_before_acquire(false)
            .connect_with(options)
            .await?)
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

    fn sql(&self) -> &Arc<Sql> {
        self.outbox.sql()
    }

    /// The statement opening a claim transaction (simple protocol), the claim
    /// statement (bind: limit) and the statement recording published events (bind:
    /// `uuid[]`) of this configuration, for benchmarks that measure the same SQL
    /// work without the relay. Not a stable API.
    #[doc(hidden)]
    pub fn claim_and_record_sql(&self) -> (&'static str, &str, &str) {
        let record = match self.config.retention {
            Retention::Delete => &self.sql().delete_published,
            Retention::Keep(_) => &self.sql().mark_published,
        };
        (
            self.begin_statement(),
            self.sql()
                .claim(self.config.ordering, self.config.after_dead_letter),
            record,
        )
    }

    fn begin_statement(&self) -> &'static str {
        if self.config.synchronous_commit {
            "BEGIN"
        } else {
            "BEGIN; SET LOCAL synchronous_commit = off"
        }
    }

    async fn claim_batch(&self, limit: usize) -> Result<PgClaim> {
        let limit = i64::try_from(limit)
            .map_err(|_| Error::InvalidConfig("batch size too large".into()))?;
        let mut tx = self.pool.begin_with(self.begin_statement()).await?;
        self.waker.claiming();
        let rows = sqlx::query(
            self.sql()
                .claim(self.config.ordering, self.config.after_dead_letter),
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let events = rows
            .iter()
            .map(row::event)
            .collect::<Result<Vec<Event>, _>>()?;
        self.waker.claimed(events.len());
        if events.is_empty() {
            tx.commit().await?;
            return Ok(PgClaim {
                tx: None,
                events,
                sql: Arc::clone(self.sql()),
                retention: self.config.retention,
            });
        }
        Ok(PgClaim {
            tx: Some(tx),
            events,
            sql: Arc::clone(self.sql()),
            retention: self.config.retention,
        })
    }
}

impl Store for PgStore {
    type Claim = PgClaim;

    async fn claim(&self, limit: usize) -> Result<PgClaim, StoreError> {
        Ok(self.claim_batch(limit).await?)
    }

    async fn pending(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(&self.sql().count_pending)
            .fetch_one(&self.pool)
            .await
            .map_err(Error::from)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn wait_for_events(&self, timeout: Duration) {
        self.waker.wait(&self.pool, timeout).await;
    }
}

/// A batch of locked events; dropping it without [`Claim::complete`] rolls back and
/// releases them.
#[derive(Debug)]
pub struct PgClaim {
    tx: Option<Transaction<'static, Postgres>>,
    events: Vec<Event>,
    sql: Arc<Sql>,
    retention: Retention,
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
        for (event, decision) in self.events.iter().zip(decisions) {
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
            }
        }
        if !published.is_empty() {
            let statement = match self.retention {
                Retention::Delete => &self.sql.delete_published,
                Retention::Keep(_) => &self.sql.mark_published,
            };
            sqlx::query(statement)
                .bind(&published)
                .execute(&mut *tx)
                .await?;
        }
        if !failed_ids.is_empty() {
            sqlx::query(&self.sql.record_failures)
                .bind(&failed_ids)
                .bind(&errors)
                .bind(&delays_ms)
                .bind(&dead)
                .execute(&mut *tx)
                .await?;
        }
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
}
