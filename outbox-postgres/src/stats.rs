//! A snapshot of the outbox for operators.

use std::time::Duration;

use sqlx::Row;

use crate::error::Result;
use crate::store::PgStore;

/// Counts describing an outbox at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
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
}

impl PgStore {
    /// Count pending, scheduled, dead and recently published events (one table scan).
    pub async fn stats(&self) -> Result<OutboxStats> {
        let row = sqlx::query(&self.outbox().sql().stats)
            .fetch_one(self.pool())
            .await?;
        let count =
            |i: usize| -> Result<u64> { Ok(u64::try_from(row.try_get::<i64, _>(i)?).unwrap_or(0)) };
        let age: f64 = row.try_get(3)?;
        Ok(OutboxStats {
            pending: count(0)?,
            scheduled: count(1)?,
            dead_letters: count(2)?,
            oldest_pending_age: Duration::try_from_secs_f64(age.max(0.0)).unwrap_or_default(),
            processed_last_hour: count(4)?,
        })
    }
}
