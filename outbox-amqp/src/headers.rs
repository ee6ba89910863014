//! Names of the AMQP headers carrying the event metadata (next to the `message_id`,
//! `type`, `timestamp` and `content_type` properties).

/// The event id (also the `message_id` property).
pub const EVENT_ID: &str = "outbox-event-id";
/// The event type (also the `type` property when it fits in 255 bytes).
pub const EVENT_TYPE: &str = "outbox-event-type";
/// The aggregate type.
pub const AGGREGATE_TYPE: &str = "outbox-aggregate-type";
/// The aggregate id.
pub const AGGREGATE_ID: &str = "outbox-aggregate-id";
/// When the event was written, RFC 3339 with microseconds, UTC.
pub const CREATED_AT: &str = "outbox-created-at";

/// Headers set by the publisher; a user header with one of these names is overridden.
pub const RESERVED: [&str; 5] = [
    EVENT_ID,
    EVENT_TYPE,
    AGGREGATE_TYPE,
    AGGREGATE_ID,
    CREATED_AT,
];

pub(crate) fn is_reserved(name: &str) -> bool {
    RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name))
}
