//! A snapshot of the outbox for operators.

use std::time::Duration;

use pgoutbox_core::{OutboxStats, StatsAdmin, StoreError};
use sqlx::{PgConnection, Row};

use crate::error::Result;
use crate::sql::Sql;
use crate::store::PgStore;

/// Who holds back vacuum: the oldest snapshot in the cluster, and the oldest open
/// producer transaction of one outbox ([`PgStore::horizon`]).
///
/// A snapshot held for long (pg_dump, a long report, an idle session in a
/// transaction, a replica with `hot_standby_feedback`) stops vacuum everywhere in
/// the cluster: tables and indexes grow until it ends. Relays do not slow down for
/// it; they do for a transaction that took an event's `seq` and stays open, whose
/// event every claim must wait for (walks start no later than it).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Horizon {
    /// How long the oldest transaction holding a snapshot has run.
    pub oldest_snapshot_age: Option<Duration>,
    /// Which session holds the oldest snapshot: pid, application (or process
    /// kind) and state.
    pub oldest_snapshot_holder: Option<String>,
    /// Age in transactions of the oldest xmin of any kind: sessions, replication
    /// slots and the replicas' feedback, prepared transactions.
    pub xmin_age: Option<u64>,
    /// How long the oldest open transaction that took a `seq` of this outbox has
    /// run.
    pub oldest_producer_age: Option<Duration>,
}

impl PgStore {
    /// Count pending, scheduled, dead and recently published events and held
    /// aggregates, each through an index: what it reads grows with those events,
    /// not with the rows kept for retention or left for vacuum by a held snapshot.
    /// Pending events are counted as the relay counts them, from the walk start
    /// (`walk_start.rs`); the oldest pending age is the oldest `created_at` among them.
    pub async fn stats(&self) -> Result<OutboxStats> {
        let statement = if self.config().ordering {
            &self.sql().stats_ordered
        } else {
            &self.sql().stats_unordered
        };
        let statement = Sql::guarded(statement, self.counting_walk_start().await);
        // One simple query: its settings end with its implicit transaction
        // (pooler-safe, see `pooler.rs`).
        let row = sqlx::raw_sql(&statement).fetch_one(self.pool()).await?;
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

    /// Who holds back the xmin horizon of the cluster (vacuum removes no row
    /// version that the oldest snapshot may still see), and the oldest open
    /// producer transaction of this outbox.
    pub async fn horizon(&self) -> Result<Horizon> {
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query(&self.sql().horizon)
            .persistent(self.outbox().persistent())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        let seconds = |column: &str| -> Result<Option<Duration>> {
            Ok(row
                .try_get::<Option<f64>, _>(column)?
                .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or_default()))
        };
        Ok(Horizon {
            oldest_snapshot_age: seconds("snapshot_age")?,
            oldest_snapshot_holder: row.try_get("holder")?,
            xmin_age: row
                .try_get::<Option<i64>, _>("xmin_age")?
                .map(|n| u64::try_from(n).unwrap_or(0)),
            oldest_producer_age: seconds("producer_age")?,
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
        let sql = self.sql();
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
