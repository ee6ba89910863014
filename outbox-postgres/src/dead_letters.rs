//! Dead-letter administration: count, list, show, retry, purge.

use std::sync::Arc;

use pgoutbox_core::{DeadLetter, DeadLetterAdmin, DeadLetterFilter, StoreError};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgPool, Postgres, Row};
use uuid::Uuid;

use crate::enqueue::Outbox;
use crate::error::Result;
use crate::row;
use crate::sql::Sql;

/// Bind `filter`'s fields as the parameters `$1..$6` of a dead-letter statement.
fn bind_filter<'q>(
    filter: &'q DeadLetterFilter,
    query: Query<'q, Postgres, PgArguments>,
) -> Query<'q, Postgres, PgArguments> {
    query
        .bind(filter.event_type.as_deref())
        .bind(filter.aggregate_type.as_deref())
        .bind(filter.aggregate_id.as_deref())
        .bind(filter.older_than.map(|d| d.as_secs_f64()))
        .bind(filter.ids.as_deref())
        .bind(filter.error_contains.as_deref())
}

/// A page of a dead-letter listing: its size and the dead letter it follows.
struct Page {
    limit: i64,
    after: Option<Uuid>,
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
        self.list_after(filter, None, limit).await
    }

    /// Up to `limit` dead letters matching `filter` that come after the dead letter
    /// `after` (the last one of the previous page), oldest event first: pages
    /// through many. A cursor whose event is gone (purged, or published and
    /// deleted since a retry) ends the listing: start again without one.
    pub async fn list_after(
        &self,
        filter: &DeadLetterFilter,
        after: Option<Uuid>,
        limit: u32,
    ) -> Result<Vec<DeadLetter>> {
        let page = Page {
            limit: i64::from(limit),
            after,
        };
        let rows = self.rows(&self.sql.dead_list, filter, Some(page)).await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetter::new(
                    row::event(r)?,
                    row::get(r, row::column::dead::LAST_ERROR)?,
                    row::get(r, row::column::dead::DEAD_AT)?,
                ))
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

    /// Run `statement` with `filter` (and the page, for the list). In a transaction,
    /// so that a pooler keeps one server connection for the statement's round trips
    /// (see `pooler.rs`).
    async fn rows(
        &self,
        statement: &str,
        filter: &DeadLetterFilter,
        page: Option<Page>,
    ) -> Result<Vec<PgRow>> {
        let mut query = bind_filter(filter, sqlx::query(statement).persistent(self.persistent));
        if let Some(page) = page {
            query = query.bind(page.limit).bind(page.after);
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

/// The binary's `dead-letters` commands go through this trait.
impl DeadLetterAdmin for DeadLetters {
    async fn count(&self, filter: &DeadLetterFilter) -> std::result::Result<u64, StoreError> {
        DeadLetters::count(self, filter)
            .await
            .map_err(StoreError::backend)
    }

    async fn list(
        &self,
        filter: &DeadLetterFilter,
        limit: u32,
    ) -> std::result::Result<Vec<DeadLetter>, StoreError> {
        DeadLetters::list(self, filter, limit)
            .await
            .map_err(StoreError::backend)
    }

    async fn show(&self, id: Uuid) -> std::result::Result<Option<DeadLetter>, StoreError> {
        DeadLetters::show(self, id)
            .await
            .map_err(StoreError::backend)
    }

    async fn retry(&self, filter: &DeadLetterFilter) -> std::result::Result<u64, StoreError> {
        DeadLetters::retry(self, filter)
            .await
            .map_err(StoreError::backend)
    }

    async fn purge(&self, filter: &DeadLetterFilter) -> std::result::Result<u64, StoreError> {
        DeadLetters::purge(self, filter)
            .await
            .map_err(StoreError::backend)
    }
}
