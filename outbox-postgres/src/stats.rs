//! A snapshot of the outbox for operators.

use std::time::Duration;

use sqlx::Row;

use crate::error::Result;
use crate::store::PgStore;

/// Counts describing an outbox at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Events waiting to be published (due or scheduled later, not dead).
    pub pending: u64,
    /// Pending events not due yet (backing off after a failure, or delayed).
    pub scheduled: u64,
    /// Dead letters.
    pub dead_letters: u64,
    /// Age of the oldest pending event.
    pub oldest_pending_age: Duration,
    /// Events published in the last hour (only counted with [`crate::Retention::Keep`]).
    pub processed_last_hour: u64,
    /// Aggregates held back (ordering on): their oldest event is backing off after a
    /// failure, delayed, or a dead letter that blocks them; their later events wait.
    pub held_aggregates: u64,
}

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
        Ok(OutboxStats {
            pending: count(0)?,
            scheduled: count(1)?,
            dead_letters: count(2)?,
            oldest_pending_age: Duration::try_from_secs_f64(age.max(0.0)).unwrap_or_default(),
            processed_last_hour: count(4)?,
            held_aggregates: count(5)?,
        })
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
        let due: i64 = sqlx::query_scalar(&sql.count_due)
            .bind(probe)
            .persistent(persistent)
            .fetch_one(&mut *tx)
            .await?;
        if due > i64::from(limit) {
            tx.rollback().await?;
            return Ok(None);
        }
        if self.config().ordering {
            let held: i64 = sqlx::query_scalar(&sql.count_due_in_locked_aggregates)
                .bind(probe)
                .persistent(persistent)
                .fetch_one(&mut *tx)
                .await?;
            tx.rollback().await?;
            return Ok(Some(u64::try_from(held).unwrap_or(0)));
        }
        let unlocked: i64 = sqlx::query_scalar(&sql.count_due_unlocked)
            .bind(probe)
            .persistent(persistent)
            .fetch_one(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok(Some(u64::try_from(due - unlocked).unwrap_or(0)))
    }
}
