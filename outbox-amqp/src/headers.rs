//! Names of the AMQP headers carrying the event metadata (next to the `message_id`,
//! `type`, `timestamp` and `content_type` properties): the shared envelope names of
//! [`pgoutbox_core::envelope`].

use pgoutbox_core::envelope::Binding;

/// The CloudEvents AMQP protocol binding: attributes in `cloudEvents:` headers
/// (binary mode); the content type is the message's `content_type` property.
pub const BINDING: Binding = Binding::new("cloudEvents:", None);

pub use pgoutbox_core::envelope::{
    AGGREGATE_ID, AGGREGATE_TYPE, CREATED_AT, EVENT_ID, EVENT_TYPE, RESERVED,
};
