//! Consumer side: read the event id and metadata from a lapin delivery.

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use pgoutbox_core::{envelope, Headers, TRACEPARENT};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::headers;

/// The outbox metadata of a delivery.
///
/// ```no_run
/// # fn demo(delivery: &pgoutbox_amqp::lapin::message::Delivery) -> Result<(), pgoutbox_amqp::Error> {
/// let meta = pgoutbox_amqp::Metadata::from_delivery(delivery)?;
/// println!("{} {}", meta.id, meta.event_type);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metadata {
    /// The event id: the dedup key for the consumer's inbox.
    pub id: Uuid,
    /// The event type.
    pub event_type: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// When the event was written, if the header is present and valid.
    pub created_at: Option<DateTime<Utc>>,
    /// The user headers, including `traceparent`, without the outbox's own headers.
    pub headers: Headers,
}

impl Metadata {
    /// Read the metadata from a delivery published by [`crate::AmqpPublisher`] (a
    /// `BasicGetMessage` derefs to a delivery). Errors name what is missing or invalid.
    pub fn from_delivery(delivery: &Delivery) -> Result<Self> {
        let not_event = |reason: String| Error::NotAnEvent {
            exchange: delivery.exchange.to_string(),
            reason,
        };
        let props = &delivery.properties;
        // Name/value pairs for the shared parser; the first value of a name wins, so
        // the `message_id` property comes before the headers and the `type` property
        // after them (the event type header is preferred to it).
        let mut pairs: Vec<(String, String)> = Vec::new();
        if let Some(id) = props.message_id() {
            pairs.push((headers::EVENT_ID.into(), id.to_string()));
        }
        if let Some(table) = props.headers() {
            for (name, value) in table.inner() {
                let text = match value {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    AMQPValue::ShortString(s) => s.to_string(),
                    _ => continue,
                };
                pairs.push((name.to_string(), text));
            }
        }
        if let Some(kind) = props.kind() {
            pairs.push((headers::EVENT_TYPE.into(), kind.to_string()));
        }
        // The creation time is optional here: an invalid one reads as absent (`None`).
        let valid_time = pairs
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(headers::CREATED_AT))
            .is_some_and(|(_, t)| DateTime::parse_from_rfc3339(t).is_ok());
        if !valid_time {
            pairs.retain(|(k, _)| !k.eq_ignore_ascii_case(headers::CREATED_AT));
        }
        let meta =
            envelope::Metadata::from_headers(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .map_err(|e| not_event(e.to_string()))?;
        Ok(Self {
            id: meta.event_id,
            event_type: meta.event_type,
            aggregate_type: meta.aggregate_type,
            aggregate_id: meta.aggregate_id,
            created_at: meta.created_at,
            headers: meta.headers,
        })
    }

    /// Read `body` (the message's payload) as `T`; an error names the event id and
    /// type ([`pgoutbox_core::DecodeError`]).
    pub fn decode<T: DeserializeOwned>(
        &self,
        body: &[u8],
    ) -> std::result::Result<T, pgoutbox_core::DecodeError> {
        pgoutbox_core::envelope::decode(self.id, &self.event_type, body)
    }

    /// The W3C `traceparent`, if the producer recorded one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(TRACEPARENT).map(String::as_str)
    }
}
