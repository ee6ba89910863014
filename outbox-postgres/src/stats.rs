//! A snapshot of the outbox for operators.

use std::time::Duration;

use pgoutbox_core::{OutboxStats, StatsAdmin, StoreError};
use sqlx::{PgConnection, Row};

use crate::error::Result;
use crate::store::PgStore;

impl PgStore {
    /// Count pending, scheduled, dead and recently published events (one table scan)
    /// and held aggregates.
    pub async fn stats(&self) -> Result<OutboxStats> {
        // In a transaction, so that a pooler keeps one server connection for the
        // statement's round trips (see `pooler.rs`).
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query(&self.outbox().sql().stats)
            .persistent(self.outbox().persistent())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        let count =
            |i: usize| -> Result<u64> { Ok(u64::try_from(row.try_get::<i64, _>(i)?).unwrap_or(0)) };
        let age: f64 = row.try_get(3)?;
        let mut stats = OutboxStats::default();
        stats.pending = count(0)?;
        stats.scheduled = count(1)?;
        stats.dead_letters = count(2)?;
        stats.oldest_pending_age = Duration::try_from_secs_f64(age.max(0.0)).unwrap_or_default();
        stats.processed_last_hour = count(4)?;
        stats.held_aggregates = count(5)?;
        Ok(stats)
    }

    /// Due events claimed by relays right now, or `None` when more than `limit` are
    /// due and probing would be costly. Approximate: rows change while counting.
    ///
    /// With ordering on (claims lock aggregates), the due events of the aggregates
    /// relays hold, read from `pg_locks`: the claimed runs plus any later events of
    /// those aggregates. With ordering off (claims lock rows), due events minus those
    /// this session can lock with `FOR KEY SHARE SKIP LOCKED`, in a transaction
    /// rolled back at once.
    pub async fn in_flight(&self, limit: u32) -> Result<Option<u64>> {
        let sql = self.outbox().sql();
        let persistent = self.outbox().persistent();
        let probe = i64::from(limit) + 1;
        let mut tx = self.pool().begin().await?;
        let due = count_due(&mut tx, &sql.count_due, probe, persistent).await?;
        let in_flight = if due > i64::from(limit) {
            None
        } else if self.config().ordering {
            let statement = &sql.count_due_in_locked_aggregates;
            Some(count_due(&mut tx, statement, probe, persistent).await?)
        } else {
            let statement = &sql.count_due_unlocked;
            Some(due - count_due(&mut tx, statement, probe, persistent).await?)
        };
        tx.rollback().await?;
        Ok(in_flight.map(|n| u64::try_from(n).unwrap_or(0)))
    }
}

/// Run one of the `count_due*` statements: they look at `probe` due events at most
/// (`limit + 1`: enough to tell that more than `limit` are due), so that probing
/// stays cheap however long the backlog.
async fn count_due(
    connection: &mut PgConnection,
    statement: &str,
    probe: i64,
    persistent: bool,
) -> Result<i64> {
    Ok(sqlx::query_scalar(statement)
        .bind(probe)
        .persistent(persistent)
        .fetch_one(connection)
        .await?)
}

/// The binary's `stats` command and gauges go through this trait.
impl StatsAdmin for PgStore {
    async fn stats(&self) -> std::result::Result<OutboxStats, StoreError> {
        PgStore::stats(self).await.map_err(StoreError::backend)
    }
}
