//! The [`Publisher`] trait: hand a batch of events to a broker, get one [`Outcome`] per event.

use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::event::Event;

/// What happened to one event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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

    /// A failure of the broker as a whole, with this message.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Failed(PublishError::unavailable(message))
    }

    /// The failure, if this is one.
    pub fn error(&self) -> Option<&PublishError> {
        match self {
            Self::Published => None,
            Self::Failed(error) => Some(error),
        }
    }
}

/// Whose failure it is, and whether trying the same message again can succeed.
///
/// `Retryable` and `Permanent` are failures of one message: they count an attempt,
/// and enough of them dead-letter the event. `Unavailable` is a failure of the
/// broker as a whole: it counts no attempt; the relay stops claiming and probes the
/// broker ([`Publisher::check`]) until it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// This message failed, for a reason that may pass (a nack, throttling, a
    /// timeout of this message while others went through): try it again later.
    Retryable,
    /// Too large, unroutable, invalid destination: the same message will fail again.
    Permanent,
    /// The broker as a whole failed, not the message: unreachable, connection lost,
    /// authentication refused, every message of the batch timed out.
    Unavailable,
}

/// A failure to publish one event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
#[non_exhaustive]
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

    /// A failure of the broker as a whole; the event counts no attempt.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Unavailable,
            message: message.into(),
        }
    }

    /// True if the same message may go through later (a retryable failure, or the
    /// broker being unavailable).
    pub fn is_retryable(&self) -> bool {
        self.kind != FailureKind::Permanent
    }

    /// True if the broker as a whole failed, not this message.
    pub fn is_unavailable(&self) -> bool {
        self.kind == FailureKind::Unavailable
    }
}

/// How far an ordered run of one aggregate's events went ([`Publisher::publish_run`]).
///
/// The first [`RunOutcome::published`] events of the run were published, in order;
/// the next one failed with [`RunOutcome::failure`]; the events after it are left
/// pending, held back behind it. Build one with [`RunOutcome::complete`] or
/// [`RunOutcome::failed`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunOutcome {
    /// Events of the run's head that were published.
    pub published: usize,
    /// Why the event after them was not; `None` when the whole run was published.
    pub failure: Option<PublishError>,
}

impl RunOutcome {
    /// Every event of a run of `len` events was published.
    pub fn complete(len: usize) -> Self {
        Self {
            published: len,
            failure: None,
        }
    }

    /// The first `published` events were published; the next one failed with `error`.
    pub fn failed(published: usize, error: PublishError) -> Self {
        Self {
            published,
            failure: Some(error),
        }
    }

    /// The outcome of a run from the per-event outcomes of its first events, in
    /// order: the head of published ones and the first failure.
    ///
    /// A message published after a failed one (what the broker's mechanism should
    /// have prevented) is logged as an error: it may reach consumers ahead of the
    /// failed event's retry or replay.
    pub fn from_outcomes(outcomes: impl IntoIterator<Item = Outcome>) -> Self {
        let mut outcomes = outcomes.into_iter();
        let mut published = 0;
        for outcome in outcomes.by_ref() {
            match outcome {
                Outcome::Published => published += 1,
                Outcome::Failed(error) => {
                    let overtaking = outcomes.filter(|o| o == &Outcome::Published).count();
                    if overtaking > 0 {
                        tracing::error!(
                            failed_at = published,
                            overtaking,
                            %error,
                            "messages of a run were published after a failed one of it; \
                             consumers may see them ahead of its retry"
                        );
                    }
                    return Self::failed(published, error);
                }
            }
        }
        Self::complete(published)
    }
}

/// How a publisher sends a run of one aggregate's events ([`Publisher::run_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RunOrder {
    /// One event per broker round trip: each after the broker acknowledged the one
    /// before. The relay publishes the claim in waves, one event of each aggregate
    /// per [`Publisher::publish`] call, and never calls [`Publisher::publish_run`].
    #[default]
    OneAtATime,
    /// [`Publisher::publish_run`] sends a whole run with many messages in flight and
    /// keeps its order across failures (see there).
    Pipelined,
}

/// Publishes batches of events to a broker.
///
/// The contract, checked by the conformance suite (`conformance` feature):
/// - return exactly one [`Outcome`] per event, in the order of `events`;
/// - return only after the broker acknowledged or refused each message;
/// - keep the order of events of one aggregate within the batch;
/// - every message carries the event id as its dedup key;
/// - never panic or hang on a broker that is down: report
///   [`FailureKind::Unavailable`] for the messages that the outage failed, and fail
///   [`Publisher::check`] while it lasts.
///
/// Tell a failure of the broker ([`FailureKind::Unavailable`]: no connection,
/// connection lost, authentication refused, every message timed out) from a failure
/// of one message ([`FailureKind::Retryable`], [`FailureKind::Permanent`]). When a
/// publisher cannot tell, it reports `Retryable`; the relay then asks
/// [`Publisher::check`] once a whole wave of a batch failed, and treats the failures
/// as an outage if the check fails too.
///
/// A publisher of your own drives a [`crate::Relay`] like the built-in ones (and the
/// `outbox` binary through `pgoutbox_relay::App::broker`); run the conformance
/// suites against your real broker (`conformance_tests!`, and
/// `pgoutbox_postgres::relay_conformance_tests!` through the relay):
///
/// ```no_run
/// use pgoutbox_core::{Event, Outcome, PublishError, Publisher, Relay, Store};
///
/// /// Posts each event to an HTTP endpoint, the event id as idempotency key.
/// struct Webhook {
///     url: String,
/// }
///
/// impl Webhook {
///     /// Your HTTP client here: the response status, or `None` without an answer.
///     async fn post(&self, _event: &Event) -> Option<u16> {
///         Some(200)
///     }
/// }
///
/// impl Publisher for Webhook {
///     async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
///         let mut outcomes = Vec::with_capacity(events.len());
///         for event in events {
///             outcomes.push(match self.post(event).await {
///                 Some(200..=299) => Outcome::Published,
///                 // Refused for good: dead-lettered at once.
///                 Some(status @ 400..=499) => {
///                     Outcome::permanent(format!("{} refused {}: {status}", self.url, event.id))
///                 }
///                 Some(status) => Outcome::retryable(format!("{} answered {status}", self.url)),
///                 // No answer: the endpoint as a whole, no attempt counted.
///                 None => Outcome::unavailable(format!("{} does not answer", self.url)),
///             });
///         }
///         outcomes
///     }
///
///     async fn check(&self) -> Result<(), PublishError> {
///         Ok(()) // e.g. a HEAD request; fail with PublishError::unavailable
///     }
/// }
///
/// async fn run(store: impl Store, shutdown: impl std::future::Future<Output = ()> + Send) {
///     let webhook = Webhook { url: "https://billing.example/events".into() };
///     Relay::new(store, webhook).run(shutdown).await;
/// }
/// ```
pub trait Publisher: Send + Sync {
    /// Publish `events`, concurrently where the broker allows, and report each outcome.
    fn publish(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send;

    /// Whether the broker is reachable now and would take messages. The relay probes
    /// it during an outage and resumes when it passes; readiness checks call it too.
    /// Fail with [`FailureKind::Unavailable`]. Defaults to `Ok(())`.
    fn check(&self) -> impl Future<Output = Result<(), PublishError>> + Send {
        async { Ok(()) }
    }

    /// Whether [`Publisher::publish_run`] pipelines a run. Defaults to
    /// [`RunOrder::OneAtATime`]: the relay publishes runs in waves through
    /// [`Publisher::publish`], as for any publisher.
    fn run_order(&self) -> RunOrder {
        RunOrder::OneAtATime
    }

    /// Publish `run`, events of one aggregate in insertion order, and say how far it
    /// went: the relay records the published head, the failure of the next event, and
    /// leaves the rest pending to be retried from the failed one.
    ///
    /// The contract: when event `k` of the run is not published, the broker must not
    /// have stored any event after `k` unless it stored `k` before it (a failure of
    /// unknown outcome, such as a lost acknowledgement). Consumers then never see
    /// an event ahead of an earlier one of its run: not after `k`'s retry, not after
    /// its replay from the dead letters, not while followers of a dead letter are
    /// blocked. Sending message `k + 1` only after `k` was acknowledged gives this;
    /// a pipelining publisher needs the broker's help (see the broker crates).
    ///
    /// Defaults to one [`Publisher::publish`] call per event, stopping at the first
    /// failure. The relay calls it only when [`Publisher::run_order`] says
    /// [`RunOrder::Pipelined`].
    fn publish_run(&self, run: &[Event]) -> impl Future<Output = RunOutcome> + Send {
        async move {
            for (k, event) in run.iter().enumerate() {
                let outcome = self.publish(std::slice::from_ref(event)).await;
                match outcome.into_iter().next() {
                    Some(Outcome::Published) => {}
                    Some(Outcome::Failed(error)) => return RunOutcome::failed(k, error),
                    None => {
                        return RunOutcome::failed(
                            k,
                            PublishError::retryable("publisher returned no outcome"),
                        )
                    }
                }
            }
            RunOutcome::complete(run.len())
        }
    }
}

impl<P: Publisher + ?Sized> Publisher for Arc<P> {
    fn publish(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send {
        (**self).publish(events)
    }

    fn check(&self) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).check()
    }

    fn run_order(&self) -> RunOrder {
        (**self).run_order()
    }

    fn publish_run(&self, run: &[Event]) -> impl Future<Output = RunOutcome> + Send {
        (**self).publish_run(run)
    }
}

impl<P: Publisher + ?Sized> Publisher for Box<P> {
    fn publish(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send {
        (**self).publish(events)
    }

    fn check(&self) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).check()
    }

    fn run_order(&self) -> RunOrder {
        (**self).run_order()
    }

    fn publish_run(&self, run: &[Event]) -> impl Future<Output = RunOutcome> + Send {
        (**self).publish_run(run)
    }
}

/// The object-safe form of [`Publisher`], for choosing a publisher at run time
/// (`Box<dyn DynPublisher>`, `Arc<dyn DynPublisher>`): every [`Publisher`] is one,
/// and `dyn DynPublisher` is a [`Publisher`] again, so a boxed publisher goes
/// wherever a publisher does ([`Relay::new`](crate::Relay::new) included). The
/// cost is one allocation per call, next to a broker round trip.
///
/// ```
/// use std::sync::Arc;
/// use pgoutbox_core::{DynPublisher, NullPublisher, StdoutPublisher};
///
/// let quiet = true;
/// let publisher: Arc<dyn DynPublisher> = if quiet {
///     Arc::new(NullPublisher)
/// } else {
///     Arc::new(StdoutPublisher)
/// };
/// # let _ = publisher;
/// ```
pub trait DynPublisher: Send + Sync {
    /// [`Publisher::publish`], boxed.
    fn publish_boxed<'a>(&'a self, events: &'a [Event]) -> BoxFuture<'a, Vec<Outcome>>;
    /// [`Publisher::check`], boxed.
    fn check_boxed(&self) -> BoxFuture<'_, Result<(), PublishError>>;
    /// [`Publisher::run_order`].
    fn run_order_dyn(&self) -> RunOrder;
    /// [`Publisher::publish_run`], boxed.
    fn publish_run_boxed<'a>(&'a self, run: &'a [Event]) -> BoxFuture<'a, RunOutcome>;
}

impl<P: Publisher> DynPublisher for P {
    fn publish_boxed<'a>(&'a self, events: &'a [Event]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(self.publish(events))
    }

    fn check_boxed(&self) -> BoxFuture<'_, Result<(), PublishError>> {
        Box::pin(self.check())
    }

    fn run_order_dyn(&self) -> RunOrder {
        self.run_order()
    }

    fn publish_run_boxed<'a>(&'a self, run: &'a [Event]) -> BoxFuture<'a, RunOutcome> {
        Box::pin(self.publish_run(run))
    }
}

// For every object lifetime, not only `'static`: a relay over
// `Arc<dyn DynPublisher>` is then `Send` for the compiler, and can be spawned
// (with `'static` alone: "implementation of `Publisher` is not general enough").
impl Publisher for dyn DynPublisher + '_ {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.publish_boxed(events).await
    }

    async fn check(&self) -> Result<(), PublishError> {
        self.check_boxed().await
    }

    fn run_order(&self) -> RunOrder {
        self.run_order_dyn()
    }

    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        self.publish_run_boxed(run).await
    }
}
