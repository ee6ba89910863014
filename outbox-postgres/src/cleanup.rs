//! Retention: deleting published rows and old inbox records in bounded batches.

use std::sync::Arc;
use std::time::Duration;

use pgoutbox_core::{RetentionAdmin, StoreError};
use sqlx::PgPool;

use crate::enqueue::Outbox;
use crate::error::Result;
use crate::sql::Sql;

/// Deletes what retention allows, a bounded batch per statement, so the relay and
/// producers are never locked out for long.
#[derive(Debug, Clone)]
pub struct Cleanup {
    pool: PgPool,
    sql: Arc<Sql>,
    persistent: bool,
    batch_size: i64,
    name: String,
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
        self.in_batches(&self.sql.cleanup_processed, retention)
            .await
    }

    /// Delete inbox records older than `retention`. Keep them longer than any
    /// redelivery can arrive (broker retention, relay retries), or a late duplicate
    /// would be processed again. Returns the number deleted.
    pub async fn inbox_older_than(&self, retention: Duration) -> Result<u64> {
        self.in_batches(&self.sql.cleanup_inbox, retention).await
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

    async fn in_batches(&self, statement: &str, retention: Duration) -> Result<u64> {
        let mut total = 0;
        loop {
            // In a transaction, so that a pooler keeps one server connection for the
            // statement's round trips (see `pooler.rs`).
            let mut tx = self.pool.begin().await?;
            let deleted = sqlx::query(statement)
                .bind(retention.as_secs_f64())
                .bind(self.batch_size)
                .persistent(self.persistent)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            total += deleted;
            if deleted < self.batch_size as u64 {
                return Ok(total);
            }
        }
    }
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
