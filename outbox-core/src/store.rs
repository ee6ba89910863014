//! The storage side of the relay: claim a batch, then record what happened to each event.
//!
//! Claim and record are the only capabilities the relay needs; administration
//! (dead letters, cleanup, statistics) lives in the separate traits of
//! [`crate::admin`], which a store implements when it can.

use std::future::Future;
use std::time::Duration;

use crate::event::Event;

/// A store the relay can claim events from.
pub trait Store: Send + Sync {
    /// A claimed batch; dropping it without [`Claim::complete`] releases the events.
    type Claim: Claim;

    /// Claim up to `limit` events that are due for publishing and not claimed by anyone else.
    ///
    /// With per-aggregate ordering on, a store returns, for each aggregate it claims, a
    /// *run*: the aggregate's oldest unpublished events in insertion order, starting at
    /// its oldest one and ending before the first that is not due. While a claim holds
    /// an aggregate, no other claim returns any event of it. The relay publishes each
    /// run in order and holds back the rest of a run after a failure (see
    /// [`Decision::HeldBack`]).
    fn claim(&self, limit: usize) -> impl Future<Output = Result<Self::Claim, StoreError>> + Send;

    /// Whether claims keep per-aggregate order (they return runs, see [`Store::claim`]).
    /// The relay then publishes each run in order, one event after the broker
    /// acknowledged the previous one, and holds back the rest of a run after a
    /// failure. A store whose ordering is turned off answers `false`: its claims are
    /// published in one call whatever their aggregates (a hot aggregate is not
    /// limited to one broker round trip per event). Defaults to `true`.
    fn ordered(&self) -> bool {
        true
    }

    /// Number of events waiting to be published (not dead-lettered), for the pending gauge.
    fn pending(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The outbox's name: the value of the `outbox` label on every metric of a relay
    /// on this store, and a field of its logs, so that several outboxes in one
    /// process keep separate series. Defaults to `outbox`; the PostgreSQL store
    /// says `schema.table`.
    fn name(&self) -> String {
        "outbox".to_string()
    }

    /// Wait until new events may be available, or `timeout` passed. Defaults to sleeping:
    /// plain polling. Stores with a wake-up channel return earlier.
    fn wait_for_events(&self, timeout: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(timeout)
    }

    /// Called once by [`crate::Relay::run`] after its loops stopped (every batch
    /// in flight recorded): give back what the store keeps for this relay alone.
    /// The PostgreSQL store deletes the relay's row from the relays table, so that
    /// the other relays draining a backlog take over its share at their next
    /// renewal instead of once the row expired. Defaults to nothing.
    fn stopped(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// A batch of events claimed by one relay.
pub trait Claim: Send {
    /// The claimed events.
    fn events(&self) -> &[Event];

    /// Record one decision per event (same order as [`Claim::events`]) and release the claim.
    fn complete(
        self,
        decisions: Vec<Decision>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Give every event back unchanged and return once they are claimable again.
    ///
    /// Dropping a claim releases it too, but a store may finish that in the
    /// background (PostgreSQL rolls the transaction back when the pooled connection
    /// is next used); call this where the events must be claimable right after.
    fn release(self) -> impl Future<Output = Result<(), StoreError>> + Send
    where
        Self: Sized,
    {
        async move {
            drop(self);
            Ok(())
        }
    }
}

/// What the store must record for one claimed event.
///
/// Exhaustive on purpose (unlike [`crate::Outcome`]): every store must record
/// every decision, so a new one should stop a store from compiling rather than
/// fall into a wildcard arm that loses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Published: mark processed (or delete, per the store's retention).
    Published,
    /// Failed; try again after `delay`. Attempts + 1, `error` kept as the last error.
    Retry {
        /// Backoff before the next attempt.
        delay: Duration,
        /// The error to keep on the row.
        error: String,
    },
    /// Failed for good: attempts + 1, dead-lettered with `error`.
    DeadLetter {
        /// The error to keep on the row.
        error: String,
    },
    /// Not published because an earlier event of its aggregate in the same claim was
    /// not: left exactly as it was (still pending, no attempt counted), so that it
    /// cannot overtake the failed one.
    HeldBack,
}

/// A storage failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database (or other backend) reported an error.
    #[error("outbox store: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store was used in a way it does not support.
    #[error("outbox store: {0}")]
    Invalid(String),
}

impl StoreError {
    /// Wrap a backend error.
    pub fn backend(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Backend(Box::new(error))
    }
}
