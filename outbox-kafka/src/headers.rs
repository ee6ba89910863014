//! Names of the Kafka headers carrying the event metadata: the shared envelope
//! names of [`pgoutbox_core::envelope`], and the content type of a CloudEvent.

use pgoutbox_core::envelope::Binding;

pub use pgoutbox_core::envelope::{
    AGGREGATE_ID, AGGREGATE_TYPE, CREATED_AT, EVENT_ID, EVENT_TYPE, RESERVED,
};

/// Header with the content type, in the CloudEvents envelope (the outbox envelope
/// never sent one on Kafka: its body is always the JSON payload).
pub const CONTENT_TYPE: &str = "content-type";

/// The CloudEvents Kafka protocol binding: attributes in `ce_` headers (binary
/// mode), the content type in the `content-type` header.
pub const BINDING: Binding = Binding::new("ce_", Some(CONTENT_TYPE));
