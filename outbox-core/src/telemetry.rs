//! Metric names the relay reports through the `metrics` facade.
//!
//! Install any `metrics` recorder (Prometheus exporter, statsd...) to collect them.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Counter: events the broker acknowledged.
pub const EVENTS_PUBLISHED: &str = "outbox_events_published_total";
/// Counter with label `event_type` (see [`EventTypeLabels`]): failed publish attempts
/// (retryable or permanent).
pub const EVENTS_FAILED: &str = "outbox_events_failed_total";
/// Counter with label `event_type` (see [`EventTypeLabels`]): events moved to the dead
/// letters.
pub const EVENTS_DEAD_LETTERED: &str = "outbox_events_dead_lettered_total";
/// Counter: events held back (left pending, no attempt) behind a failed event of
/// their aggregate in the same batch.
pub const EVENTS_HELD_BACK: &str = "outbox_events_held_back_total";
/// Gauge: events waiting to be published, refreshed periodically by the relay.
pub const EVENTS_PENDING: &str = "outbox_events_pending";
/// Gauge: 1 while the broker takes messages, 0 during an outage (from the first
/// broker-wide failure until a message goes through again).
pub const BROKER_UP: &str = "outbox_broker_up";
/// Histogram: seconds one claim took, from asking the store for a batch until it
/// returned one (empty claims included). On PostgreSQL the claim is the relay's
/// share of the database work; a claim that grows slow (a plan that scans the
/// backlog, an index full of dead entries) shows here before the backlog does.
pub const CLAIM_DURATION: &str = "outbox_claim_duration_seconds";
/// Histogram: seconds to publish and record one batch.
pub const BATCH_DURATION: &str = "outbox_batch_duration_seconds";
/// Histogram: seconds from an event's creation to its broker acknowledgement.
pub const PUBLISH_LAG: &str = "outbox_publish_lag_seconds";

/// Register descriptions for all metrics (optional; exporters show them as help text).
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(EVENTS_PUBLISHED, "Events the broker acknowledged");
    describe_counter!(EVENTS_FAILED, "Failed publish attempts, by event type");
    describe_counter!(
        EVENTS_DEAD_LETTERED,
        "Events moved to the dead letters, by event type"
    );
    describe_counter!(
        EVENTS_HELD_BACK,
        "Events held back behind a failed event of their aggregate"
    );
    describe_gauge!(EVENTS_PENDING, "Events waiting to be published");
    describe_gauge!(
        BROKER_UP,
        "1 while the broker takes messages, 0 during an outage"
    );
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Time to claim one batch from the store"
    );
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "Time to publish and record one batch"
    );
    describe_histogram!(
        PUBLISH_LAG,
        Unit::Seconds,
        "Time from event creation to broker acknowledgement"
    );
    describe_counter!(
        crate::layer::PUBLISHER_EVENTS,
        "Outcomes of the events handed to a publisher (MetricsLayer), by publisher and outcome"
    );
    describe_histogram!(
        crate::layer::PUBLISHER_CALL_DURATION,
        Unit::Seconds,
        "Time of one publish call of a publisher (MetricsLayer), by publisher"
    );
}

/// The `event_type` label value for event types past the bound of [`EventTypeLabels`].
pub const OTHER_EVENT_TYPE: &str = "other";

/// Keeps the `event_type` label of the failure counters bounded.
///
/// Event types are usually a few dozen names fixed in code, but they are whatever
/// producers write: a type built from data (`invoice.{customer}`) would create one
/// time series per value in the metrics backend. The first `limit` distinct types
/// seen get their own label value; every later one is counted as
/// [`OTHER_EVENT_TYPE`], and a warning names the first type that was folded.
#[derive(Debug, Default)]
pub struct EventTypeLabels {
    seen: Mutex<HashSet<String>>,
    folded: AtomicBool,
}

impl EventTypeLabels {
    /// The label value for `event_type` when at most `limit` distinct values are kept.
    pub fn label(&self, event_type: &str, limit: usize) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(event_type) {
            return event_type.to_string();
        }
        if seen.len() < limit {
            seen.insert(event_type.to_string());
            return event_type.to_string();
        }
        drop(seen);
        if !self.folded.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                event_type,
                limit,
                "more distinct event types than the metrics keep; later ones are counted as \"other\""
            );
        }
        OTHER_EVENT_TYPE.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_types_past_the_limit_are_counted_as_other() {
        let labels = EventTypeLabels::default();
        assert_eq!(labels.label("order.created", 2), "order.created");
        assert_eq!(labels.label("order.paid", 2), "order.paid");
        assert_eq!(labels.label("order.created", 2), "order.created");
        assert_eq!(labels.label("order.shipped", 2), OTHER_EVENT_TYPE);
        assert_eq!(labels.label("order.refunded", 2), OTHER_EVENT_TYPE);
        // Known types keep their own label after the bound was reached.
        assert_eq!(labels.label("order.paid", 2), "order.paid");
    }
}
