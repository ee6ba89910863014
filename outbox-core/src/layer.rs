//! Publisher layers: behaviour that wraps any [`Publisher`] (a deadline per call,
//! metrics per call), composed in the spirit of tower's `Layer`.
//!
//! ```
//! use std::time::Duration;
//! use pgoutbox_core::layer::{MetricsLayer, PublisherExt, TimeoutLayer};
//! use pgoutbox_core::NullPublisher;
//!
//! // Innermost first: the metrics see the timeout's outcomes too.
//! let publisher = NullPublisher
//!     .layer(TimeoutLayer::new(Duration::from_secs(5)))
//!     .layer(MetricsLayer::new("webhook"));
//! # let _ = publisher;
//! ```
//!
//! A layered publisher is a [`Publisher`] like any other: it goes into a
//! [`crate::Relay`], behind [`crate::DynPublisher`], or into another layer. The
//! relay's own rules (per-aggregate hold-back, broker outage detection, its
//! claim-wide `publish_timeout`) apply to whatever the outermost layer returns.

use std::time::Duration;

// Tokio's clock, so that tests with paused time measure what they slept.
use tokio::time::Instant;

use crate::event::Event;
use crate::publisher::{FailureKind, Outcome, PublishError, Publisher, RunOrder, RunOutcome};

/// Wraps a publisher in another.
pub trait Layer<P> {
    /// The wrapping publisher.
    type Publisher: Publisher;

    /// Wrap `inner`.
    fn layer(&self, inner: P) -> Self::Publisher;
}

/// `publisher.layer(l)`: wrap a publisher in a [`Layer`].
pub trait PublisherExt: Publisher + Sized {
    /// Wrap this publisher with `layer`.
    fn layer<L: Layer<Self>>(self, layer: L) -> L::Publisher {
        layer.layer(self)
    }
}

impl<P: Publisher> PublisherExt for P {}

/// A deadline for each call of the inner publisher: a `publish` not finished in
/// time fails every event of the call as retryable (the broker may have taken some:
/// they will be published again, and consumers skip the duplicates by event id); a
/// `check` not finished in time reports the broker unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeoutLayer {
    timeout: Duration,
}

impl TimeoutLayer {
    /// A deadline of `timeout` per call.
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }
}

impl<P: Publisher> Layer<P> for TimeoutLayer {
    type Publisher = Timeout<P>;

    fn layer(&self, inner: P) -> Timeout<P> {
        Timeout {
            inner,
            timeout: self.timeout,
        }
    }
}

/// A publisher with a deadline per call; see [`TimeoutLayer`].
#[derive(Debug, Clone)]
pub struct Timeout<P> {
    inner: P,
    timeout: Duration,
}

impl<P> Timeout<P> {
    /// The wrapped publisher.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

impl<P: Publisher> Publisher for Timeout<P> {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        match tokio::time::timeout(self.timeout, self.inner.publish(events)).await {
            Ok(outcomes) => outcomes,
            Err(_) => {
                let message = format!("publish not finished within {:?}", self.timeout);
                vec![Outcome::retryable(message); events.len()]
            }
        }
    }

    async fn check(&self) -> Result<(), PublishError> {
        tokio::time::timeout(self.timeout, self.inner.check())
            .await
            .unwrap_or_else(|_| {
                Err(PublishError::unavailable(format!(
                    "broker check not finished within {:?}",
                    self.timeout
                )))
            })
    }

    fn run_order(&self) -> RunOrder {
        self.inner.run_order()
    }

    /// A run not finished in time fails from its first event: the broker may have
    /// taken a head of it, published again on retry, in order.
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        match tokio::time::timeout(self.timeout, self.inner.publish_run(run)).await {
            Ok(outcome) => outcome,
            Err(_) => RunOutcome::failed(
                0,
                PublishError::retryable(format!("publish not finished within {:?}", self.timeout)),
            ),
        }
    }
}

/// Counter with labels `publisher` and `outcome` (`published`, `retryable`,
/// `permanent`, `unavailable`): outcomes of the events handed to the publisher.
pub const PUBLISHER_EVENTS: &str = "outbox_publisher_events_total";
/// Histogram with label `publisher`: seconds per `publish` call of the publisher.
pub const PUBLISHER_CALL_DURATION: &str = "outbox_publisher_call_duration_seconds";

/// Metrics per call of the inner publisher, labelled with a name
/// ([`PUBLISHER_EVENTS`], [`PUBLISHER_CALL_DURATION`]): how long the broker takes
/// and what it answers, apart from the relay's own figures (which include the
/// database).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsLayer {
    name: String,
}

impl MetricsLayer {
    /// Metrics labelled `publisher = name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self { name: name.into() }
    }
}

impl<P: Publisher> Layer<P> for MetricsLayer {
    type Publisher = Metered<P>;

    fn layer(&self, inner: P) -> Metered<P> {
        Metered {
            inner,
            name: self.name.clone(),
        }
    }
}

/// A publisher whose calls are measured; see [`MetricsLayer`].
#[derive(Debug, Clone)]
pub struct Metered<P> {
    inner: P,
    name: String,
}

impl<P> Metered<P> {
    /// The wrapped publisher.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

impl<P> Metered<P> {
    /// Count `published` events and the kinds of `failures`, for one call that
    /// started at `started`.
    fn record<'a>(
        &self,
        started: Instant,
        published: usize,
        failures: impl Iterator<Item = &'a PublishError>,
    ) {
        metrics::histogram!(PUBLISHER_CALL_DURATION, "publisher" => self.name.clone())
            .record(started.elapsed().as_secs_f64());
        let mut counts = [published as u64, 0, 0, 0];
        for error in failures {
            let i = match error.kind {
                FailureKind::Retryable => 1,
                FailureKind::Permanent => 2,
                FailureKind::Unavailable => 3,
            };
            counts[i] += 1;
        }
        for (label, count) in ["published", "retryable", "permanent", "unavailable"]
            .into_iter()
            .zip(counts)
            .filter(|(_, count)| *count > 0)
        {
            metrics::counter!(PUBLISHER_EVENTS, "publisher" => self.name.clone(), "outcome" => label)
                .increment(count);
        }
    }
}

impl<P: Publisher> Publisher for Metered<P> {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let started = Instant::now();
        let outcomes = self.inner.publish(events).await;
        let published = outcomes.iter().filter(|o| o.error().is_none()).count();
        self.record(
            started,
            published,
            outcomes.iter().filter_map(Outcome::error),
        );
        outcomes
    }

    fn check(&self) -> impl std::future::Future<Output = Result<(), PublishError>> + Send {
        self.inner.check()
    }

    fn run_order(&self) -> RunOrder {
        self.inner.run_order()
    }

    /// Counts the run's published head and its failed event (the events held back
    /// behind it were not handed to the broker: not counted).
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        let started = Instant::now();
        let outcome = self.inner.publish_run(run).await;
        self.record(started, outcome.published, outcome.failure.iter());
        outcome
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    fn event(aggregate_id: &str, n: i64) -> Event {
        let payload = serde_json::value::RawValue::from_string(format!("{{\"n\":{n}}}"))
            .unwrap_or_else(|e| panic!("valid JSON: {e}"));
        Event::new(
            uuid::Uuid::now_v7(),
            "order",
            aggregate_id,
            "order.created",
            payload,
            chrono::Utc::now(),
        )
    }

    /// Publishes after `delay`, answering `outcome` for every event.
    struct Slow {
        delay: Duration,
        outcome: Outcome,
    }

    impl Publisher for Slow {
        async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
            tokio::time::sleep(self.delay).await;
            vec![self.outcome.clone(); events.len()]
        }

        async fn check(&self) -> Result<(), PublishError> {
            tokio::time::sleep(self.delay).await;
            Ok(())
        }
    }

    fn slow(delay: Duration) -> Slow {
        Slow {
            delay,
            outcome: Outcome::Published,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_past_its_deadline_fails_every_event_as_retryable() {
        let events = [event("a", 1), event("b", 1)];
        let timeout = Duration::from_secs(5);
        let late = slow(Duration::from_secs(6)).layer(TimeoutLayer::new(timeout));
        let outcomes = late.publish(&events).await;
        assert_eq!(outcomes.len(), 2);
        for outcome in &outcomes {
            let error = outcome.error().expect("failed");
            assert_eq!(error.kind, FailureKind::Retryable);
            assert!(error.message.contains("5s"), "{}", error.message);
        }
        assert!(late.check().await.unwrap_err().is_unavailable());

        let in_time = slow(Duration::from_secs(4)).layer(TimeoutLayer::new(timeout));
        assert_eq!(in_time.publish(&events).await, vec![Outcome::Published; 2]);
        assert_eq!(in_time.check().await, Ok(()));
    }

    #[test]
    fn metrics_count_outcomes_and_time_each_call_by_publisher_name() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let events = [event("a", 1), event("a", 2), event("b", 1)];
        let layered = Arc::new(
            Slow {
                delay: Duration::from_millis(30),
                outcome: Outcome::permanent("refused"),
            }
            .layer(MetricsLayer::new("webhook")),
        );
        metrics::with_local_recorder(&recorder, || {
            // The recorder is thread-local: drive the call to completion here.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap_or_else(|e| panic!("runtime: {e}"));
            runtime.block_on(layered.publish(&events));
        });
        let mut seen = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            match value {
                DebugValue::Counter(n) => seen.push(format!("{} {labels:?} {n}", key.key().name())),
                DebugValue::Histogram(values) => {
                    assert_eq!(values.len(), 1);
                    assert!(values[0].into_inner() >= 0.03, "{values:?}");
                    seen.push(format!("{} {labels:?}", key.key().name()));
                }
                DebugValue::Gauge(_) => {}
            }
        }
        seen.sort();
        assert_eq!(
            seen,
            [
                "outbox_publisher_call_duration_seconds [\"publisher=webhook\"]",
                "outbox_publisher_events_total [\"publisher=webhook\", \"outcome=permanent\"] 3",
            ]
        );
    }
}
