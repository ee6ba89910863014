//! Metric names the relay reports through the `metrics` facade.
//!
//! Install any `metrics` recorder (Prometheus exporter, statsd...) to collect them.

/// Counter: events the broker acknowledged.
pub const EVENTS_PUBLISHED: &str = "outbox_events_published_total";
/// Counter with label `event_type`: failed publish attempts (retryable or permanent).
pub const EVENTS_FAILED: &str = "outbox_events_failed_total";
/// Counter with label `event_type`: events moved to the dead letters.
pub const EVENTS_DEAD_LETTERED: &str = "outbox_events_dead_lettered_total";
/// Counter: events held back (left pending, no attempt) behind a failed event of
/// their aggregate in the same batch.
pub const EVENTS_HELD_BACK: &str = "outbox_events_held_back_total";
/// Gauge: events waiting to be published, refreshed periodically by the relay.
pub const EVENTS_PENDING: &str = "outbox_events_pending";
/// Gauge: 1 while the broker takes messages, 0 during an outage (from the first
/// broker-wide failure until a message goes through again).
pub const BROKER_UP: &str = "outbox_broker_up";
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
        BATCH_DURATION,
        Unit::Seconds,
        "Time to publish and record one batch"
    );
    describe_histogram!(
        PUBLISH_LAG,
        Unit::Seconds,
        "Time from event creation to broker acknowledgement"
    );
}
