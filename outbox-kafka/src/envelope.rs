//! The message envelope: headers written, and read back on the consumer side.

use pgoutbox_core::envelope::{self, Encoded, EnvelopeError, Metadata};
use rdkafka::message::{Header, Headers as _, Message, OwnedHeaders};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::headers::{BINDING, CONTENT_TYPE, RESERVED};

/// The Kafka headers of an encoded event: the envelope's metadata, then the event's
/// own headers (`traceparent` and user metadata) under their names, then the
/// content type when the envelope names one.
pub(crate) fn headers(encoded: &Encoded<'_>) -> OwnedHeaders {
    let mut headers =
        OwnedHeaders::new_with_capacity(encoded.metadata.len() + encoded.headers.len() + 1);
    for (key, value) in encoded.all_headers() {
        headers = headers.insert(Header {
            key,
            value: Some(value),
        });
    }
    if let Some(content_type) = encoded.content_type {
        headers = headers.insert(Header {
            key: CONTENT_TYPE,
            value: Some(content_type),
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
                    if let Some(&name) = RESERVED.iter().find(|r| r.eq_ignore_ascii_case(h.key)) {
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
    Metadata::from_message(&BINDING, pairs, None, message.payload().unwrap_or_default()).map_err(
        |e| match e {
            EnvelopeError::Missing(name) => Error::MissingHeader { name },
            EnvelopeError::Malformed { name, reason } => Error::InvalidHeader { name, reason },
            other => Error::CloudEvent(other),
        },
    )
}

/// Only the event id of a received message (the dedup key), in any envelope.
pub fn event_id<M: Message>(message: &M) -> Result<Uuid> {
    metadata(message).map(|m| m.event_id)
}
