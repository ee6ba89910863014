//! Dead-letter administration: count, list, show, retry, purge.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use pgoutbox_core::Event;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgPool, Postgres, Row};
use uuid::Uuid;

use crate::enqueue::Outbox;
use crate::error::Result;
use crate::row;
use crate::sql::Sql;

/// Which dead letters an operation applies to. Every field set narrows the
/// selection; the default selects all dead letters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    pub aggregate_id: Option<String>,
    /// Only events dead-lettered longer ago than this.
    pub older_than: Option<Duration>,
    /// Only these event ids.
    pub ids: Option<Vec<Uuid>>,
}

impl DeadLetterFilter {
    /// Only the event with this id.
    pub fn id(id: Uuid) -> Self {
        Self {
            ids: Some(vec![id]),
            ..Self::default()
        }
    }

    /// Narrow to this event type.
    #[must_use]
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Narrow to this aggregate type.
    #[must_use]
    pub fn aggregate_type(mut self, aggregate_type: impl Into<String>) -> Self {
        self.aggregate_type = Some(aggregate_type.into());
        self
    }

    /// Narrow to this aggregate id.
    #[must_use]
    pub fn aggregate_id(mut self, aggregate_id: impl Into<String>) -> Self {
        self.aggregate_id = Some(aggregate_id.into());
        self
    }

    /// Narrow to events dead-lettered longer ago than `age`.
    #[must_use]
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    fn bind<'q>(
        &'q self,
        query: Query<'q, Postgres, PgArguments>,
    ) -> Query<'q, Postgres, PgArguments> {
        query
            .bind(self.event_type.as_deref())
            .bind(self.aggregate_type.as_deref())
            .bind(self.aggregate_id.as_deref())
            .bind(self.older_than.map(|d| d.as_secs_f64()))
            .bind(self.ids.as_deref())
    }
}

/// A dead-lettered event with why and when it died.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The event (attempts = attempts made).
    pub event: Event,
    /// The last publish error.
    pub last_error: Option<String>,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
}

/// Administration of the dead letters of one outbox.
///
/// Dead letters are rows with `dead_at` set (the `outbox_dead_letters` view); they
/// leave the claim index, so they never slow or block healthy events.
#[derive(Debug, Clone)]
pub struct DeadLetters {
    pool: PgPool,
    sql: Arc<Sql>,
    persistent: bool,
}

impl DeadLetters {
    /// Dead letters of `outbox` on `pool`.
    pub fn new(pool: PgPool, outbox: &Outbox) -> Self {
        Self {
            pool,
            sql: Arc::clone(outbox.sql()),
            persistent: outbox.persistent(),
        }
    }

    /// Number of dead letters matching `filter`.
    pub async fn count(&self, filter: &DeadLetterFilter) -> Result<u64> {
        self.counted(&self.sql.dead_count, filter).await
    }

    /// Up to `limit` dead letters matching `filter`, oldest event first.
    pub async fn list(&self, filter: &DeadLetterFilter, limit: u32) -> Result<Vec<DeadLetter>> {
        let rows = self
            .rows(&self.sql.dead_list, filter, Some(i64::from(limit)))
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetter {
                    event: row::event(r)?,
                    last_error: row::get(r, row::column::dead::LAST_ERROR)?,
                    dead_at: row::get(r, row::column::dead::DEAD_AT)?,
                })
            })
            .collect()
    }

    /// One dead letter by event id.
    pub async fn show(&self, id: Uuid) -> Result<Option<DeadLetter>> {
        Ok(self
            .list(&DeadLetterFilter::id(id), 1)
            .await?
            .into_iter()
            .next())
    }

    /// Make the matching dead letters publishable again: attempts reset to 0,
    /// due now. Returns how many were reset.
    ///
    /// With ordering on and [`crate::AfterDeadLetter::Release`], followers of a
    /// dead letter may already be published; a retried event then arrives after them.
    /// With [`crate::AfterDeadLetter::Block`], the aggregate's hold is lifted and the
    /// retried event goes first.
    pub async fn retry(&self, filter: &DeadLetterFilter) -> Result<u64> {
        self.counted(&self.sql.dead_retry, filter).await
    }

    /// Delete the matching dead letters for good. Returns how many were deleted.
    pub async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64> {
        self.counted(&self.sql.dead_purge, filter).await
    }

    /// Run `statement` with `filter` (and `limit`, for the list). In a transaction,
    /// so that a pooler keeps one server connection for the statement's round trips
    /// (see `pooler.rs`).
    async fn rows(
        &self,
        statement: &str,
        filter: &DeadLetterFilter,
        limit: Option<i64>,
    ) -> Result<Vec<PgRow>> {
        let mut query = filter.bind(sqlx::query(statement).persistent(self.persistent));
        if let Some(limit) = limit {
            query = query.bind(limit);
        }
        let mut tx = self.pool.begin().await?;
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// The count `statement` returns (its one row's one column).
    async fn counted(&self, statement: &str, filter: &DeadLetterFilter) -> Result<u64> {
        let rows = self.rows(statement, filter, None).await?;
        let n: i64 = match rows.first() {
            Some(row) => row.try_get(0)?,
            None => 0,
        };
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
