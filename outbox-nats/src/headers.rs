//! Names of the NATS headers carrying the event metadata.

/// JetStream's dedup key header: the event id.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The event id (also in [`MSG_ID`], which JetStream may strip on republish).
pub const EVENT_ID: &str = "Outbox-Event-Id";
/// The event type.
pub const EVENT_TYPE: &str = "Outbox-Event-Type";
/// The aggregate type.
pub const AGGREGATE_TYPE: &str = "Outbox-Aggregate-Type";
/// The aggregate id.
pub const AGGREGATE_ID: &str = "Outbox-Aggregate-Id";
/// When the event was written, RFC 3339 with microseconds, UTC.
pub const CREATED_AT: &str = "Outbox-Created-At";
/// The content type of the payload: always `application/json`.
pub const CONTENT_TYPE: &str = "Content-Type";

/// Headers set by the publisher; a user header with one of these names is
/// overridden (names compared ignoring ASCII case).
pub const RESERVED: [&str; 7] = [
    MSG_ID,
    EVENT_ID,
    EVENT_TYPE,
    AGGREGATE_TYPE,
    AGGREGATE_ID,
    CREATED_AT,
    CONTENT_TYPE,
];

pub(crate) fn is_reserved(name: &str) -> bool {
    RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name))
}
