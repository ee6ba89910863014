//! The [`Publisher`] trait: hand a batch of events to a broker, get one [`Outcome`] per event.

use std::future::Future;
use std::sync::Arc;

use crate::event::Event;

/// What happened to one event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The broker acknowledged the message (publisher confirm, PubAck, delivery report...).
    Published,
    /// The broker did not take the message.
    Failed(PublishError),
}

impl Outcome {
    /// A retryable failure with this message.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::Failed(PublishError::retryable(message))
    }

    /// A permanent failure with this message.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Failed(PublishError::permanent(message))
    }
}

/// Whether trying the same message again can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Broker down, timeout, throttling: try again later.
    Retryable,
    /// Too large, unroutable, invalid destination: the same message will fail again.
    Permanent,
}

/// A failure to publish one event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    /// Retryable or permanent.
    pub kind: FailureKind,
    /// What went wrong, kept on the outbox row as the last error.
    pub message: String,
}

impl PublishError {
    /// A failure that may succeed later.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Retryable,
            message: message.into(),
        }
    }

    /// A failure that will not succeed on retry; the event is dead-lettered at once.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Permanent,
            message: message.into(),
        }
    }

    /// True if the event should be retried.
    pub fn is_retryable(&self) -> bool {
        self.kind == FailureKind::Retryable
    }
}

/// Publishes batches of events to a broker.
///
/// The contract, checked by the conformance suite (`conformance` feature):
/// - return exactly one [`Outcome`] per event, in the order of `events`;
/// - return only after the broker acknowledged or refused each message;
/// - keep the order of events of one aggregate within the batch;
/// - every message carries the event id as its dedup key;
/// - never panic or hang on a broker that is down: report [`FailureKind::Retryable`].
pub trait Publisher: Send + Sync {
    /// Publish `events`, concurrently where the broker allows, and report each outcome.
    fn publish(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send;

    /// Whether the broker is reachable now (for readiness checks). Defaults to `Ok(())`.
    fn check(&self) -> impl Future<Output = Result<(), PublishError>> + Send {
        async { Ok(()) }
    }
}

impl<P: Publisher> Publisher for Arc<P> {
    fn publish(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send {
        (**self).publish(events)
    }

    fn check(&self) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).check()
    }
}
