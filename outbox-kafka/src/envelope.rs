//! The message envelope: header names, and reading them back on the consumer side.

use chrono::{DateTime, SecondsFormat, Utc};
use outbox_core::{Event, Headers, TRACEPARENT};
use rdkafka::message::{Header, Headers as _, Message, OwnedHeaders};
use uuid::Uuid;

use crate::error::{Error, Result};

/// Header with the event id: the consumer's dedup key.
pub const HEADER_EVENT_ID: &str = "outbox-event-id";
/// Header with the event type.
pub const HEADER_EVENT_TYPE: &str = "outbox-event-type";
/// Header with the aggregate type.
pub const HEADER_AGGREGATE_TYPE: &str = "outbox-aggregate-type";
/// Header with the aggregate id (also the message key).
pub const HEADER_AGGREGATE_ID: &str = "outbox-aggregate-id";
/// Header with the creation time of the event, RFC 3339 in UTC.
pub const HEADER_CREATED_AT: &str = "outbox-created-at";

/// The names this crate sets; user headers with these names are not sent.
pub const RESERVED_HEADERS: [&str; 5] = [
    HEADER_EVENT_ID,
    HEADER_EVENT_TYPE,
    HEADER_AGGREGATE_TYPE,
    HEADER_AGGREGATE_ID,
    HEADER_CREATED_AT,
];

/// The Kafka headers of `event`: the outbox metadata, then the event's own headers
/// (`traceparent` and user metadata) under their names.
pub(crate) fn headers(event: &Event) -> OwnedHeaders {
    let id = event.id.to_string();
    let created_at = event
        .created_at
        .to_rfc3339_opts(SecondsFormat::Micros, true);
    let mut headers = OwnedHeaders::new_with_capacity(RESERVED_HEADERS.len() + event.headers.len())
        .insert(header(HEADER_EVENT_ID, &id))
        .insert(header(HEADER_EVENT_TYPE, &event.event_type))
        .insert(header(HEADER_AGGREGATE_TYPE, &event.aggregate_type))
        .insert(header(HEADER_AGGREGATE_ID, &event.aggregate_id))
        .insert(header(HEADER_CREATED_AT, &created_at));
    for (name, value) in &event.headers {
        if RESERVED_HEADERS.contains(&name.as_str()) {
            tracing::debug!(event_id = %event.id, header = %name, "reserved header name; not sent");
            continue;
        }
        headers = headers.insert(header(name, value));
    }
    headers
}

fn header<'a>(key: &'a str, value: &'a String) -> Header<'a, &'a String> {
    Header {
        key,
        value: Some(value),
    }
}

/// The outbox metadata of a received Kafka message.
///
/// ```no_run
/// # fn demo(message: &rdkafka::message::BorrowedMessage<'_>) -> Result<(), outbox_kafka::Error> {
/// let received = outbox_kafka::Received::from_message(message)?;
/// println!("{} {} ({})", received.event_type, received.event_id, received.aggregate_id);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
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
        let mut event_id = None;
        let mut event_type = None;
        let mut aggregate_type = None;
        let mut aggregate_id = None;
        let mut created_at = None;
        let mut headers = Headers::new();
        if let Some(all) = message.headers() {
            for h in all.iter() {
                let value = |name: &'static str| -> Result<String> {
                    let bytes = h.value.unwrap_or_default();
                    String::from_utf8(bytes.to_vec()).map_err(|e| Error::InvalidHeader {
                        name,
                        reason: e.to_string(),
                    })
                };
                match h.key {
                    HEADER_EVENT_ID => {
                        let text = value(HEADER_EVENT_ID)?;
                        event_id =
                            Some(Uuid::parse_str(&text).map_err(|e| Error::InvalidHeader {
                                name: HEADER_EVENT_ID,
                                reason: format!("{text:?} is not a UUID: {e}"),
                            })?);
                    }
                    HEADER_EVENT_TYPE => event_type = Some(value(HEADER_EVENT_TYPE)?),
                    HEADER_AGGREGATE_TYPE => aggregate_type = Some(value(HEADER_AGGREGATE_TYPE)?),
                    HEADER_AGGREGATE_ID => aggregate_id = Some(value(HEADER_AGGREGATE_ID)?),
                    HEADER_CREATED_AT => {
                        let text = value(HEADER_CREATED_AT)?;
                        let at = DateTime::parse_from_rfc3339(&text).map_err(|e| {
                            Error::InvalidHeader {
                                name: HEADER_CREATED_AT,
                                reason: format!("{text:?} is not an RFC 3339 time: {e}"),
                            }
                        })?;
                        created_at = Some(at.with_timezone(&Utc));
                    }
                    name => {
                        // User headers are UTF-8 when the outbox wrote them; skip foreign ones.
                        if let Some(text) = h.value.and_then(|v| std::str::from_utf8(v).ok()) {
                            headers.insert(name.to_string(), text.to_string());
                        }
                    }
                }
            }
        }
        Ok(Self {
            event_id: event_id.ok_or(Error::MissingHeader {
                name: HEADER_EVENT_ID,
            })?,
            event_type: event_type.ok_or(Error::MissingHeader {
                name: HEADER_EVENT_TYPE,
            })?,
            aggregate_type: aggregate_type.ok_or(Error::MissingHeader {
                name: HEADER_AGGREGATE_TYPE,
            })?,
            aggregate_id: aggregate_id.ok_or(Error::MissingHeader {
                name: HEADER_AGGREGATE_ID,
            })?,
            created_at: created_at.ok_or(Error::MissingHeader {
                name: HEADER_CREATED_AT,
            })?,
            headers,
        })
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
