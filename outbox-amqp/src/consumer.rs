//! Consumer side: read the event id and metadata from a lapin delivery.

use chrono::DateTime;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use pgoutbox_core::envelope::Metadata;

use crate::error::{Error, Result};
use crate::headers;

/// The outbox metadata of a delivery published by [`crate::AmqpPublisher`] (a
/// `BasicGetMessage` derefs to a delivery), the same [`Metadata`] type as every
/// adapter's. Errors name what is missing or invalid; an invalid creation time
/// reads as absent.
///
/// ```no_run
/// # fn demo(delivery: &pgoutbox_amqp::lapin::message::Delivery) -> Result<(), pgoutbox_amqp::Error> {
/// let meta = pgoutbox_amqp::metadata(delivery)?;
/// println!("{} {}", meta.event_id, meta.event_type);
/// # Ok(()) }
/// ```
pub fn metadata(delivery: &Delivery) -> Result<Metadata> {
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
    Metadata::from_message(
        &headers::BINDING,
        pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        props.content_type().as_ref().map(|t| t.as_str()),
        &delivery.data,
    )
    .map_err(|e| not_event(e.to_string()))
}
