//! Names of the SQS message attributes carrying the event metadata: the shared
//! envelope names of [`pgoutbox_core::envelope`], the content type of a
//! CloudEvent, and the attribute that packs user headers when they do not fit.

use pgoutbox_core::envelope::Binding;

pub use pgoutbox_core::envelope::{AGGREGATE_ID, AGGREGATE_TYPE, CREATED_AT, EVENT_ID, EVENT_TYPE};

/// Attribute with all user headers as one JSON object, used when they do not fit
/// as separate attributes (see the crate docs).
pub const PACKED_HEADERS: &str = "outbox-headers";

/// Attribute with the content type of a structured CloudEvent.
pub const CONTENT_TYPE: &str = "content-type";

/// CloudEvents attributes travel as `ce-` attributes (binary mode), the content type
/// of a structured one as `content-type`: SQS has no CloudEvents binding, so this
/// follows the HTTP one, whose names SQS accepts.
pub const BINDING: Binding = Binding::new("ce-", Some(CONTENT_TYPE));

/// SQS's limit of message attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;
