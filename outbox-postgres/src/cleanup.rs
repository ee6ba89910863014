//! Retention: deleting published rows and old inbox records in bounded batches.
//!
//! Each batch deletes the oldest rows from where the previous one ended (the
//! newest `processed_at` it deleted), not from the beginning of the index: a
//! deleted row's index entry stays until vacuum removes it, and while any session
//! holds back the xmin horizon vacuum removes none, so batches that all started at
//! the beginning would each step over every row deleted before them (a cleanup of
//! a large history quadratic in its size). A row marked published with an older
//! `processed_at` than one already deleted, by a transaction that committed later,
//! is found when the position goes back to the beginning, at most every
//! [`RESCAN_EVERY`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use pgoutbox_core::{RetentionAdmin, StoreError};
use sqlx::{PgPool, Row};

use crate::enqueue::Outbox;
use crate::error::Result;
use crate::sql::Sql;

/// How often cleanup goes back to the beginning of the index.
const RESCAN_EVERY: Duration = Duration::from_secs(3600);

/// Deletes what retention allows, a bounded batch per statement, so the relay and
/// producers are never locked out for long.
#[derive(Debug, Clone)]
pub struct Cleanup {
    pool: PgPool,
    sql: Arc<Sql>,
    persistent: bool,
    batch_size: i64,
    name: String,
    processed: Arc<Mutex<Position>>,
    inbox: Arc<Mutex<Position>>,
}

/// Where the next batch of one kind of cleanup starts.
#[derive(Debug)]
struct Position {
    /// The newest `processed_at` deleted so far (`None`: from the beginning).
    after: Option<DateTime<Utc>>,
    since: Instant,
}

impl Position {
    fn new() -> Self {
        Self {
            after: None,
            since: Instant::now(),
        }
    }

    /// Where to start now: back to the beginning every [`RESCAN_EVERY`].
    fn start(&mut self, now: Instant) -> Option<DateTime<Utc>> {
        if now.saturating_duration_since(self.since) >= RESCAN_EVERY {
            *self = Self {
                after: None,
                since: now,
            };
        }
        self.after
    }
}

impl Cleanup {
    /// Cleanup of `outbox` on `pool`, deleting at most 1,000 rows per statement.
    pub fn new(pool: PgPool, outbox: &Outbox) -> Self {
        Self {
            pool,
            sql: Arc::clone(outbox.sql()),
            persistent: outbox.persistent(),
            batch_size: 1000,
            name: outbox.tables().outbox_name(),
            processed: Arc::new(Mutex::new(Position::new())),
            inbox: Arc::new(Mutex::new(Position::new())),
        }
    }

    /// The outbox's name in metrics and logs (`schema.table`).
    pub fn name(&self) -> String {
        self.name.clone()
    }

    /// Rows deleted per statement. Defaults to 1,000.
    #[must_use]
    pub fn with_batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = i64::from(batch_size.max(1));
        self
    }

    /// Delete published rows (those with `processed_at`, kept by
    /// [`crate::Retention::Keep`]) older than `retention`. Pending and dead-lettered
    /// rows are never touched. Returns the number deleted.
    pub async fn processed_older_than(&self, retention: Duration) -> Result<u64> {
        self.in_batches(&self.sql.cleanup_processed, &self.processed, retention)
            .await
    }

    /// Delete inbox records older than `retention`. Keep them longer than any
    /// redelivery can arrive (broker retention, relay retries), or a late duplicate
    /// would be processed again. Returns the number deleted.
    pub async fn inbox_older_than(&self, retention: Duration) -> Result<u64> {
        self.in_batches(&self.sql.cleanup_inbox, &self.inbox, retention)
            .await
    }

    /// Run retention every `every` until `shutdown` completes: published rows older
    /// than `processed` and, when given, inbox records older than `inbox`. Errors are
    /// logged and retried at the next round.
    pub async fn run(
        &self,
        every: Duration,
        processed: Duration,
        inbox: Option<Duration>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            match self.processed_older_than(processed).await {
                Ok(n) if n > 0 => tracing::info!(deleted = n, "outbox cleanup: published rows"),
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "outbox cleanup failed"),
            }
            if let Some(age) = inbox {
                match self.inbox_older_than(age).await {
                    Ok(n) if n > 0 => tracing::info!(deleted = n, "outbox cleanup: inbox records"),
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "outbox inbox cleanup failed"),
                }
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(every) => {}
            }
        }
    }

    async fn in_batches(
        &self,
        statement: &str,
        position: &Mutex<Position>,
        retention: Duration,
    ) -> Result<u64> {
        let mut total = 0;
        loop {
            let after = lock(position).start(Instant::now());
            // In a transaction, so that a pooler keeps one server connection for the
            // statement's round trips (see `pooler.rs`).
            let mut tx = self.pool.begin().await?;
            let row = sqlx::query(statement)
                .bind(retention.as_secs_f64())
                .bind(self.batch_size)
                .bind(after)
                .persistent(self.persistent)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            let deleted: i64 = row.try_get(0)?;
            let newest: Option<DateTime<Utc>> = row.try_get(1)?;
            if let Some(newest) = newest {
                let mut position = lock(position);
                position.after = position.after.max(Some(newest));
            }
            let deleted = u64::try_from(deleted).unwrap_or(0);
            total += deleted;
            if deleted < self.batch_size as u64 {
                return Ok(total);
            }
        }
    }
}

fn lock(position: &Mutex<Position>) -> std::sync::MutexGuard<'_, Position> {
    // Two numbers updated in one step: a panic elsewhere cannot leave them half-written.
    position
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The binary's `cleanup` command goes through this trait.
impl RetentionAdmin for Cleanup {
    async fn delete_published_older_than(
        &self,
        age: Duration,
    ) -> std::result::Result<u64, StoreError> {
        self.processed_older_than(age)
            .await
            .map_err(StoreError::backend)
    }

    async fn delete_inbox_older_than(&self, age: Duration) -> std::result::Result<u64, StoreError> {
        self.inbox_older_than(age)
            .await
            .map_err(StoreError::backend)
    }
}
