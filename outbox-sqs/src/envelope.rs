//! The message envelope: attribute names and layout, and reading them back.

use std::collections::HashMap;

use aws_sdk_sqs::types::{Message, MessageAttributeValue};
use pgoutbox_core::envelope::{self, EnvelopeError, Metadata};
use pgoutbox_core::{Event, TRACEPARENT};
use uuid::Uuid;

use crate::error::{Error, Result};

pub use pgoutbox_core::envelope::{
    AGGREGATE_ID as ATTR_AGGREGATE_ID, AGGREGATE_TYPE as ATTR_AGGREGATE_TYPE,
    CREATED_AT as ATTR_CREATED_AT, EVENT_ID as ATTR_EVENT_ID, EVENT_TYPE as ATTR_EVENT_TYPE,
};
/// Attribute with all user headers as one JSON object, used when they do not fit
/// as separate attributes (see the crate docs).
pub const ATTR_HEADERS: &str = "outbox-headers";

/// SQS's limit of message attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;

const STRING: &str = "String";

/// The attributes of `event` as (name, value) pairs, all of type `String`.
///
/// Always: the five outbox attributes and `traceparent` when present. The other
/// headers each become an attribute when all of them fit within SQS's 10 and have
/// names and values SQS accepts; otherwise all of them travel as one JSON object in
/// [`ATTR_HEADERS`]. Nothing is dropped.
pub(crate) fn attributes(event: &Event) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut rest: Vec<(&str, &str)> = Vec::new();
    for (name, value) in envelope::headers(event) {
        // The envelope leaves out user headers with reserved names, so a reserved
        // name here is the metadata.
        if envelope::is_reserved(name) || (name == TRACEPARENT && !value.is_empty()) {
            out.push((name.to_string(), value.into_owned()));
        } else if let Some((name, value)) = event.headers.get_key_value(name) {
            rest.push((name, value));
        }
    }
    // User headers with reserved names are not dropped: their names are not valid
    // attributes, so they travel packed in `ATTR_HEADERS`.
    rest.extend(
        event
            .headers
            .iter()
            .filter(|(n, _)| envelope::is_reserved(n))
            .map(|(n, v)| (n.as_str(), v.as_str())),
    );
    let fit = out.len() + rest.len() <= MAX_ATTRIBUTES
        && rest
            .iter()
            .all(|(n, v)| valid_attribute_name(n) && !v.is_empty());
    if fit {
        out.extend(
            rest.into_iter()
                .map(|(n, v)| (n.to_string(), v.to_string())),
        );
    } else if !rest.is_empty() {
        let object: serde_json::Map<String, serde_json::Value> = rest
            .into_iter()
            .map(|(n, v)| (n.to_string(), serde_json::Value::String(v.to_string())))
            .collect();
        out.push((
            ATTR_HEADERS.to_string(),
            serde_json::Value::Object(object).to_string(),
        ));
    }
    out
}

/// Bytes SQS counts for a message: body plus each attribute's name, type and value.
pub(crate) fn message_size(body: &str, attributes: &[(String, String)]) -> usize {
    body.len()
        + attributes
            .iter()
            .map(|(n, v)| n.len() + STRING.len() + v.len())
            .sum::<usize>()
}

/// SQS attribute names: 1 to 256 of `[A-Za-z0-9_.-]`, no leading, trailing or double
/// `.`, no `AWS.`/`Amazon.` prefix, and not one of ours.
fn valid_attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
        && !envelope::is_reserved(name)
        && name != ATTR_HEADERS
}

pub(crate) fn attribute_value(value: String) -> Option<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type(STRING)
        .string_value(value)
        .build()
        .ok()
}

/// The outbox metadata of a received SQS message, the same [`Metadata`] type as
/// every adapter's. Receive with `.message_attribute_names("All")` so the
/// attributes come along; user headers are read whether they came as separate
/// attributes or packed in [`ATTR_HEADERS`].
///
/// ```no_run
/// # async fn demo(client: aws_sdk_sqs::Client, url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// let out = client.receive_message().queue_url(url).message_attribute_names("All").send().await?;
/// for message in out.messages() {
///     let meta = pgoutbox_sqs::metadata(message)?;
///     println!("{} {}", meta.event_type, meta.event_id);
/// }
/// # Ok(()) }
/// ```
pub fn metadata(message: &Message) -> Result<Metadata> {
    metadata_from_attributes(message.message_attributes().unwrap_or(&HashMap::new()))
}

/// The outbox metadata read from message attributes (see [`metadata`]).
pub fn metadata_from_attributes(
    attributes: &HashMap<String, MessageAttributeValue>,
) -> Result<Metadata> {
    let mut pairs: Vec<(&str, &str)> = attributes
        .iter()
        .filter(|(name, _)| name.as_str() != ATTR_HEADERS)
        .filter_map(|(name, value)| Some((name.as_str(), value.string_value()?)))
        .collect();
    // Names are compared without case and the first of a repeated one wins: the
    // exact names first, so the result does not depend on the map's order.
    pairs.sort_by_key(|(name, _)| !envelope::RESERVED.contains(name));
    let mut meta = envelope::Metadata::from_headers(pairs).map_err(|e| match e {
        EnvelopeError::Missing(name) => Error::MissingAttribute { name },
        EnvelopeError::Malformed { name, reason } => Error::InvalidAttribute { name, reason },
        other => Error::InvalidAttribute {
            name: ATTR_EVENT_ID,
            reason: other.to_string(),
        },
    })?;
    if let Some(packed) = attributes.get(ATTR_HEADERS).and_then(|v| v.string_value()) {
        let object: HashMap<String, String> =
            serde_json::from_str(packed).map_err(|e| Error::InvalidAttribute {
                name: ATTR_HEADERS,
                reason: format!("not a JSON object of strings: {e}"),
            })?;
        meta.headers.extend(object);
    }
    Ok(meta)
}

/// Only the event id of a received message (the dedup key).
pub fn event_id(message: &Message) -> Result<Uuid> {
    let id = message
        .message_attributes()
        .and_then(|a| a.get(ATTR_EVENT_ID))
        .and_then(|v| v.string_value())
        .ok_or(Error::MissingAttribute {
            name: ATTR_EVENT_ID,
        })?;
    Uuid::parse_str(id).map_err(|e| Error::InvalidAttribute {
        name: ATTR_EVENT_ID,
        reason: format!("{id:?} is not a UUID: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(headers: &[(&str, &str)]) -> Event {
        let payload = serde_json::value::RawValue::from_string("{}".into()).unwrap();
        let mut event = Event::new(
            Uuid::now_v7(),
            "order",
            "1",
            "order.created",
            payload,
            chrono::Utc::now(),
        );
        event.headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        event
    }

    fn round_trip(e: &Event) -> Metadata {
        let attrs: HashMap<String, MessageAttributeValue> = attributes(e)
            .into_iter()
            .map(|(n, v)| (n, attribute_value(v).unwrap()))
            .collect();
        assert!(attrs.len() <= MAX_ATTRIBUTES, "{attrs:?}");
        metadata_from_attributes(&attrs).unwrap()
    }

    #[test]
    fn few_headers_travel_as_attributes() {
        let e = event(&[("traceparent", "00-a-b-01"), ("tenant", "acme")]);
        let names: Vec<String> = attributes(&e).into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"tenant".to_string()));
        assert!(!names.contains(&ATTR_HEADERS.to_string()));
        let r = round_trip(&e);
        assert_eq!(r.headers, e.headers);
        assert_eq!(r.event_id, e.id);
    }

    #[test]
    fn many_or_odd_headers_are_packed_not_dropped() {
        let many: Vec<(String, String)> =
            (0..8).map(|i| (format!("h{i}"), format!("v{i}"))).collect();
        let refs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let e = event(&refs);
        assert!(attributes(&e).iter().any(|(n, _)| n == ATTR_HEADERS));
        assert_eq!(round_trip(&e).headers, e.headers);

        let odd = event(&[
            ("traceparent", "00-a-b-01"),
            ("with space", "x"),
            ("empty", ""),
        ]);
        assert_eq!(round_trip(&odd).headers, odd.headers);
    }
}
