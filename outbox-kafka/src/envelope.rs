//! The message envelope: header names, and reading them back on the consumer side.

use chrono::{DateTime, Utc};
use pgoutbox_core::envelope::{self, EnvelopeError};
use pgoutbox_core::{Event, Headers, TRACEPARENT};
use rdkafka::message::{Header, Headers as _, Message, OwnedHeaders};
use serde::de::DeserializeOwned;
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

/// The outbox metadata of a received Kafka message.
///
/// ```no_run
/// # fn demo(message: &rdkafka::message::BorrowedMessage<'_>) -> Result<(), pgoutbox_kafka::Error> {
/// let received = pgoutbox_kafka::Received::from_message(message)?;
/// println!("{} {} ({})", received.event_type, received.event_id, received.aggregate_id);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Received {
    /// The event id: record it in the consumer's inbox to skip duplicates.
    pub event_id: Uuid,
    /// The event type.
    pub event_type: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// When the event was written to the outbox.
    pub created_at: DateTime<Utc>,
    /// The event's own headers: `traceparent` and user metadata.
    pub headers: Headers,
}

impl Received {
    /// Read the metadata from a message's headers ([`rdkafka::message::BorrowedMessage`]
    /// or [`rdkafka::message::OwnedMessage`]).
    pub fn from_message<M: Message>(message: &M) -> Result<Self> {
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
        let meta = envelope::Metadata::from_headers(pairs).map_err(|e| match e {
            EnvelopeError::Missing(name) => Error::MissingHeader { name },
            EnvelopeError::Malformed { name, reason } => Error::InvalidHeader { name, reason },
            other => Error::InvalidHeader {
                name: HEADER_EVENT_ID,
                reason: other.to_string(),
            },
        })?;
        Ok(Self {
            event_id: meta.event_id,
            event_type: meta.event_type,
            aggregate_type: meta.aggregate_type,
            aggregate_id: meta.aggregate_id,
            created_at: meta.created_at.ok_or(Error::MissingHeader {
                name: envelope::CREATED_AT,
            })?,
            headers: meta.headers,
        })
    }

    /// Read `body` (the message's payload) as `T`; an error names the event id and
    /// type ([`pgoutbox_core::DecodeError`]).
    pub fn decode<T: DeserializeOwned>(
        &self,
        body: &[u8],
    ) -> std::result::Result<T, pgoutbox_core::DecodeError> {
        pgoutbox_core::envelope::decode(self.event_id, &self.event_type, body)
    }

    /// The W3C `traceparent` header, when the producer recorded one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(TRACEPARENT).map(String::as_str)
    }
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
