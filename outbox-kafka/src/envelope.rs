//! The message envelope: header names, and reading them back on the consumer side.

use pgoutbox_core::envelope::{self, EnvelopeError, Metadata};
use pgoutbox_core::Event;
use rdkafka::message::{Header, Headers as _, Message, OwnedHeaders};
use uuid::Uuid;

use crate::error::{Error, Result};

pub use pgoutbox_core::envelope::{
    AGGREGATE_ID as HEADER_AGGREGATE_ID, AGGREGATE_TYPE as HEADER_AGGREGATE_TYPE,
    CREATED_AT as HEADER_CREATED_AT, EVENT_ID as HEADER_EVENT_ID, EVENT_TYPE as HEADER_EVENT_TYPE,
    RESERVED as RESERVED_HEADERS,
};

/// The Kafka headers of `event`: the outbox metadata, then the event's own headers
/// (`traceparent` and user metadata) under their names.
pub(crate) fn headers(event: &Event) -> OwnedHeaders {
    let pairs = envelope::headers(event);
    let mut headers = OwnedHeaders::new_with_capacity(pairs.len());
    for (key, value) in &pairs {
        headers = headers.insert(Header {
            key,
            value: Some(value.as_ref()),
        });
    }
    headers
}

/// The outbox metadata of a received Kafka message
/// ([`rdkafka::message::BorrowedMessage`] or [`rdkafka::message::OwnedMessage`]), the
/// same [`Metadata`] type as every adapter's.
///
/// ```no_run
/// # fn demo(message: &rdkafka::message::BorrowedMessage<'_>) -> Result<(), pgoutbox_kafka::Error> {
/// let meta = pgoutbox_kafka::metadata(message)?;
/// println!("{} {} ({})", meta.event_type, meta.event_id, meta.aggregate_id);
/// # Ok(()) }
/// ```
pub fn metadata<M: Message>(message: &M) -> Result<Metadata> {
    let mut pairs = Vec::new();
    if let Some(all) = message.headers() {
        for h in all.iter() {
            match std::str::from_utf8(h.value.unwrap_or_default()) {
                Ok(text) if h.value.is_some() || envelope::is_reserved(h.key) => {
                    pairs.push((h.key, text));
                }
                // User headers are UTF-8 when the outbox wrote them; skip foreign ones.
                Ok(_) => {}
                Err(e) => {
                    if let Some(&name) = RESERVED_HEADERS
                        .iter()
                        .find(|r| r.eq_ignore_ascii_case(h.key))
                    {
                        return Err(Error::InvalidHeader {
                            name,
                            reason: e.to_string(),
                        });
                    }
                }
            }
        }
    }
    // The last value of a repeated header wins; the shared parser keeps the first.
    pairs.reverse();
    envelope::Metadata::from_headers(pairs).map_err(|e| match e {
        EnvelopeError::Missing(name) => Error::MissingHeader { name },
        EnvelopeError::Malformed { name, reason } => Error::InvalidHeader { name, reason },
        other => Error::InvalidHeader {
            name: HEADER_EVENT_ID,
            reason: other.to_string(),
        },
    })
}

/// Only the event id of a received message (the dedup key).
pub fn event_id<M: Message>(message: &M) -> Result<Uuid> {
    let header = message
        .headers()
        .and_then(|all| all.iter().find(|h| h.key == HEADER_EVENT_ID))
        .ok_or(Error::MissingHeader {
            name: HEADER_EVENT_ID,
        })?;
    let text = header
        .value
        .and_then(|v| std::str::from_utf8(v).ok())
        .unwrap_or_default();
    Uuid::parse_str(text).map_err(|e| Error::InvalidHeader {
        name: HEADER_EVENT_ID,
        reason: format!("{text:?} is not a UUID: {e}"),
    })
}
