//! Consumer side: read the event id and metadata from a lapin delivery.

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use outbox_core::{Headers, TRACEPARENT};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::headers;

/// The outbox metadata of a delivery.
///
/// ```no_run
/// # fn demo(delivery: &outbox_amqp::lapin::message::Delivery) -> Result<(), outbox_amqp::Error> {
/// let meta = outbox_amqp::Metadata::from_delivery(delivery)?;
/// println!("{} {}", meta.id, meta.event_type);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
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
        let mut all = Headers::new();
        if let Some(table) = props.headers() {
            for (name, value) in table.inner() {
                let text = match value {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                    AMQPValue::ShortString(s) => s.to_string(),
                    _ => continue,
                };
                all.insert(name.to_string(), text);
            }
        }
        let header = |name: &str| all.get(name).cloned();
        let id_text = props
            .message_id()
            .as_ref()
            .map(ToString::to_string)
            .or_else(|| header(headers::EVENT_ID))
            .ok_or_else(|| not_event("no message_id".into()))?;
        let id = Uuid::parse_str(&id_text)
            .map_err(|e| not_event(format!("message_id `{id_text}` is not a UUID: {e}")))?;
        let required = |name: &str| {
            header(name).ok_or_else(|| not_event(format!("header `{name}` is missing")))
        };
        let event_type = match header(headers::EVENT_TYPE) {
            Some(t) => t,
            None => props
                .kind()
                .as_ref()
                .map(ToString::to_string)
                .ok_or_else(|| not_event("no event type".into()))?,
        };
        let created_at = header(headers::CREATED_AT)
            .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
            .map(|t| t.with_timezone(&Utc));
        Ok(Self {
            id,
            event_type,
            aggregate_type: required(headers::AGGREGATE_TYPE)?,
            aggregate_id: required(headers::AGGREGATE_ID)?,
            created_at,
            headers: all
                .into_iter()
                .filter(|(k, _)| !headers::is_reserved(k))
                .collect(),
        })
    }

    /// The W3C `traceparent`, if the producer recorded one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(TRACEPARENT).map(String::as_str)
    }
}
