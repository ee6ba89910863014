//! Names of the NATS headers carrying the event metadata.
//!
//! The metadata names are the shared envelope names of [`pgoutbox_core::envelope`];
//! NATS adds its dedup header and the content type.

/// JetStream's dedup key header: the event id.
pub const MSG_ID: &str = "Nats-Msg-Id";
use pgoutbox_core::envelope::Binding;
pub use pgoutbox_core::envelope::{AGGREGATE_ID, AGGREGATE_TYPE, CREATED_AT, EVENT_ID, EVENT_TYPE};
/// The content type of the body: `application/json` (the payload), or
/// `application/cloudevents+json` (a structured CloudEvent).
pub const CONTENT_TYPE: &str = "Content-Type";

/// The CloudEvents NATS protocol binding: attributes in `ce-` headers (binary
/// mode), the content type in the `Content-Type` header.
pub const BINDING: Binding = Binding::new("ce-", Some(CONTENT_TYPE));

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

/// The NATS-only names of [`RESERVED`] (the others are the envelope's).
pub(crate) fn is_nats_reserved(name: &str) -> bool {
    MSG_ID.eq_ignore_ascii_case(name) || CONTENT_TYPE.eq_ignore_ascii_case(name)
}
