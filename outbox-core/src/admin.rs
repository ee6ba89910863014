//! Administration a store may offer besides claiming: dead letters, retention and
//! statistics.
//!
//! The relay needs only [`crate::Store`]; operators need these. They are traits so
//! that the `outbox` binary's commands (`dead-letters`, `cleanup`, `stats`) work on
//! any store that implements them, not only on the PostgreSQL table.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::event::Event;
use crate::store::StoreError;

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
    /// Only dead letters whose last error contains this text (case-insensitive).
    pub error_contains: Option<String>,
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

    /// Narrow to these event ids.
    #[must_use]
    pub fn ids(mut self, ids: Vec<Uuid>) -> Self {
        self.ids = Some(ids);
        self
    }

    /// Narrow to dead letters whose last error contains `text` (case-insensitive).
    #[must_use]
    pub fn error_contains(mut self, text: impl Into<String>) -> Self {
        self.error_contains = Some(text.into());
        self
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

impl DeadLetter {
    /// A dead letter as a store reads it.
    pub fn new(event: Event, last_error: Option<String>, dead_at: DateTime<Utc>) -> Self {
        Self {
            event,
            last_error,
            dead_at,
        }
    }
}

/// Inspect, retry and purge dead letters.
pub trait DeadLetterAdmin: Send + Sync {
    /// Number of dead letters matching `filter`.
    fn count(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Up to `limit` dead letters matching `filter`, oldest event first.
    fn list(
        &self,
        filter: &DeadLetterFilter,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, StoreError>> + Send;

    /// One dead letter by event id.
    fn show(&self, id: Uuid)
        -> impl Future<Output = Result<Option<DeadLetter>, StoreError>> + Send;

    /// Make the matching dead letters publishable again (attempts reset, due now);
    /// returns how many.
    fn retry(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Delete the matching dead letters for good; returns how many.
    fn purge(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Delete what retention no longer keeps.
pub trait RetentionAdmin: Send + Sync {
    /// Delete published events older than `age`; returns how many.
    fn delete_published_older_than(
        &self,
        age: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Delete consumer inbox records older than `age`; returns how many.
    fn delete_inbox_older_than(
        &self,
        age: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Counts describing an outbox at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
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
    /// Events published in the last hour (counted only by stores that keep
    /// published events).
    pub processed_last_hour: u64,
    /// Aggregates held back (ordering on): their oldest event is backing off after a
    /// failure, delayed, or a dead letter that blocks them; their later events wait.
    pub held_aggregates: u64,
}

/// A snapshot of the outbox for operators.
pub trait StatsAdmin: Send + Sync {
    /// Pending, scheduled, dead and recently published events, held aggregates.
    fn stats(&self) -> impl Future<Output = Result<OutboxStats, StoreError>> + Send;
}
