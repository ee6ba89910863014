//! The message envelope: attributes written, and read back.

use std::collections::HashMap;

use aws_sdk_sqs::types::{Message, MessageAttributeValue};
use pgoutbox_core::envelope::cloudevents::STRUCTURED_CONTENT_TYPE;
use pgoutbox_core::envelope::{self, Encoded, EnvelopeError, Metadata};
use pgoutbox_core::TRACEPARENT;
use uuid::Uuid;

use crate::error::{Error, Result};

use crate::headers::{BINDING, CONTENT_TYPE, MAX_ATTRIBUTES, PACKED_HEADERS};

const STRING: &str = "String";

/// The attributes of an encoded event as (name, value) pairs, all of type `String`.
///
/// Always: the envelope's metadata (the five outbox attributes, or the CloudEvents
/// attributes in binary mode), `content-type` for a structured CloudEvent (how a
/// consumer tells it apart; a binary one leaves it out, its body is always the JSON
/// payload, to stay within SQS's 10 attributes), and `traceparent` when present. The
/// other headers each become an attribute when all of them fit within SQS's 10 and
/// have names and values SQS accepts; otherwise all of them travel as one JSON
/// object in [`PACKED_HEADERS`]. Nothing is dropped.
pub(crate) fn attributes(encoded: &Encoded<'_>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = encoded
        .metadata
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    if let Some(content_type) = encoded
        .content_type
        .filter(|&t| t == STRUCTURED_CONTENT_TYPE)
    {
        out.push((CONTENT_TYPE.to_string(), content_type.to_string()));
    }
    let mut rest: Vec<(&str, &str)> = Vec::new();
    for &(name, value) in &encoded.headers {
        if name == TRACEPARENT && !value.is_empty() {
            out.push((name.to_string(), value.to_string()));
        } else {
            rest.push((name, value));
        }
    }
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
            PACKED_HEADERS.to_string(),
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
        && name != PACKED_HEADERS
        && !name.eq_ignore_ascii_case(CONTENT_TYPE)
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
/// attributes or packed in [`PACKED_HEADERS`].
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
    metadata_from_attributes(
        message.message_attributes().unwrap_or(&HashMap::new()),
        message.body().unwrap_or_default(),
    )
}

/// The outbox metadata read from a message's attributes and body (see [`metadata`]).
pub fn metadata_from_attributes(
    attributes: &HashMap<String, MessageAttributeValue>,
    body: &str,
) -> Result<Metadata> {
    let mut pairs: Vec<(&str, &str)> = attributes
        .iter()
        .filter(|(name, _)| name.as_str() != PACKED_HEADERS)
        .filter_map(|(name, value)| Some((name.as_str(), value.string_value()?)))
        .collect();
    // Names are compared without case and the first of a repeated one wins: the
    // exact names first, so the result does not depend on the map's order.
    pairs.sort_by_key(|(name, _)| !envelope::RESERVED.contains(name));
    let mut meta =
        Metadata::from_message(&BINDING, pairs, None, body.as_bytes()).map_err(|e| match e {
            EnvelopeError::Missing(name) => Error::MissingAttribute { name },
            EnvelopeError::Malformed { name, reason } => Error::InvalidAttribute { name, reason },
            other => Error::CloudEvent(other),
        })?;
    if let Some(packed) = attributes
        .get(PACKED_HEADERS)
        .and_then(|v| v.string_value())
    {
        let object: HashMap<String, String> =
            serde_json::from_str(packed).map_err(|e| Error::InvalidAttribute {
                name: PACKED_HEADERS,
                reason: format!("not a JSON object of strings: {e}"),
            })?;
        meta.headers.extend(object);
    }
    Ok(meta)
}

/// Only the event id of a received message (the dedup key), in any envelope.
pub fn event_id(message: &Message) -> Result<Uuid> {
    metadata(message).map(|m| m.event_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgoutbox_core::envelope::{CloudEvents, Envelope};
    use pgoutbox_core::Event;

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

    fn envelopes() -> [Envelope; 3] {
        [
            Envelope::Outbox,
            Envelope::CloudEvents(CloudEvents::binary("/orders").unwrap()),
            Envelope::CloudEvents(CloudEvents::structured("/orders").unwrap()),
        ]
    }

    fn attrs(envelope: &Envelope, e: &Event) -> Vec<(String, String)> {
        attributes(&envelope.encode(e, &BINDING))
    }

    fn round_trip(envelope: &Envelope, e: &Event) -> Metadata {
        let encoded = envelope.encode(e, &BINDING);
        let attrs: HashMap<String, MessageAttributeValue> = attributes(&encoded)
            .into_iter()
            .map(|(n, v)| (n, attribute_value(v).unwrap()))
            .collect();
        assert!(attrs.len() <= MAX_ATTRIBUTES, "{attrs:?}");
        let body = std::str::from_utf8(&encoded.body).unwrap();
        let meta = metadata_from_attributes(&attrs, body).unwrap();
        assert_eq!(meta.event_id, e.id);
        assert_eq!(
            meta.payload(body.as_bytes()).unwrap(),
            e.payload_str().as_bytes()
        );
        meta
    }

    #[test]
    fn few_headers_travel_as_attributes() {
        let e = event(&[("traceparent", "00-a-b-01"), ("tenant", "acme")]);
        for envelope in envelopes() {
            let names: Vec<String> = attrs(&envelope, &e).into_iter().map(|(n, _)| n).collect();
            assert!(names.contains(&"tenant".to_string()), "{names:?}");
            assert!(!names.contains(&PACKED_HEADERS.to_string()));
            assert_eq!(round_trip(&envelope, &e).headers, e.headers);
        }
    }

    #[test]
    fn many_or_odd_headers_are_packed_not_dropped() {
        let many: Vec<(String, String)> = (0..9)
            .map(|i| (format!("h{i}"), format!("v{i}")))
            .chain([("traceparent".to_string(), "00-a-b-01".to_string())])
            .collect();
        let refs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let e = event(&refs);
        let odd = event(&[
            ("traceparent", "00-a-b-01"),
            ("with space", "x"),
            ("empty", ""),
        ]);
        for envelope in envelopes() {
            assert!(attrs(&envelope, &e)
                .iter()
                .any(|(n, _)| n == PACKED_HEADERS));
            assert_eq!(round_trip(&envelope, &e).headers, e.headers);
            assert_eq!(round_trip(&envelope, &odd).headers, odd.headers);
        }
    }
}
