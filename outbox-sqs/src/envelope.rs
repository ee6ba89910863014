//! The message envelope: attribute names and layout, and reading them back.

use std::collections::HashMap;

use aws_sdk_sqs::types::{Message, MessageAttributeValue};
use chrono::{DateTime, SecondsFormat, Utc};
use outbox_core::{Event, Headers, TRACEPARENT};
use uuid::Uuid;

use crate::error::{Error, Result};

/// Attribute with the event id: the consumer's dedup key (on FIFO queues also the
/// `MessageDeduplicationId`).
pub const ATTR_EVENT_ID: &str = "outbox-event-id";
/// Attribute with the event type.
pub const ATTR_EVENT_TYPE: &str = "outbox-event-type";
/// Attribute with the aggregate type.
pub const ATTR_AGGREGATE_TYPE: &str = "outbox-aggregate-type";
/// Attribute with the aggregate id (on FIFO queues also the `MessageGroupId`).
pub const ATTR_AGGREGATE_ID: &str = "outbox-aggregate-id";
/// Attribute with the creation time of the event, RFC 3339 in UTC.
pub const ATTR_CREATED_AT: &str = "outbox-created-at";
/// Attribute with all user headers as one JSON object, used when they do not fit
/// as separate attributes (see the crate docs).
pub const ATTR_HEADERS: &str = "outbox-headers";

/// SQS's limit of message attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;

const RESERVED: [&str; 6] = [
    ATTR_EVENT_ID,
    ATTR_EVENT_TYPE,
    ATTR_AGGREGATE_TYPE,
    ATTR_AGGREGATE_ID,
    ATTR_CREATED_AT,
    ATTR_HEADERS,
];

const STRING: &str = "String";

/// The attributes of `event` as (name, value) pairs, all of type `String`.
///
/// Always: the five outbox attributes and `traceparent` when present. The other
/// headers each become an attribute when all of them fit within SQS's 10 and have
/// names and values SQS accepts; otherwise all of them travel as one JSON object in
/// [`ATTR_HEADERS`]. Nothing is dropped.
pub(crate) fn attributes(event: &Event) -> Vec<(String, String)> {
    let mut out = vec![
        (ATTR_EVENT_ID.to_string(), event.id.to_string()),
        (ATTR_EVENT_TYPE.to_string(), event.event_type.clone()),
        (
            ATTR_AGGREGATE_TYPE.to_string(),
            event.aggregate_type.clone(),
        ),
        (ATTR_AGGREGATE_ID.to_string(), event.aggregate_id.clone()),
        (
            ATTR_CREATED_AT.to_string(),
            event
                .created_at
                .to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
    ];
    let mut rest: Vec<(&String, &String)> = Vec::new();
    for (name, value) in &event.headers {
        if name == TRACEPARENT && !value.is_empty() {
            out.push((name.clone(), value.clone()));
        } else {
            rest.push((name, value));
        }
    }
    let fit = out.len() + rest.len() <= MAX_ATTRIBUTES
        && rest
            .iter()
            .all(|(n, v)| valid_attribute_name(n) && !v.is_empty());
    if fit {
        out.extend(rest.into_iter().map(|(n, v)| (n.clone(), v.clone())));
    } else if !rest.is_empty() {
        let object: serde_json::Map<String, serde_json::Value> = rest
            .into_iter()
            .map(|(n, v)| (n.clone(), serde_json::Value::String(v.clone())))
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
        && !RESERVED.contains(&name)
}

pub(crate) fn attribute_value(value: String) -> Option<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type(STRING)
        .string_value(value)
        .build()
        .ok()
}

/// The outbox metadata of a received SQS message. Receive with
/// `.message_attribute_names("All")` so the attributes come along.
///
/// ```no_run
/// # async fn demo(client: aws_sdk_sqs::Client, url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// let out = client.receive_message().queue_url(url).message_attribute_names("All").send().await?;
/// for message in out.messages() {
///     let received = outbox_sqs::Received::from_message(message)?;
///     println!("{} {}", received.event_type, received.event_id);
/// }
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
    /// The event's own headers: `traceparent` and user metadata, whether they came as
    /// separate attributes or packed in [`ATTR_HEADERS`].
    pub headers: Headers,
}

impl Received {
    /// Read the metadata from a message's attributes.
    pub fn from_message(message: &Message) -> Result<Self> {
        Self::from_attributes(message.message_attributes().unwrap_or(&HashMap::new()))
    }

    /// Read the metadata from message attributes.
    pub fn from_attributes(attributes: &HashMap<String, MessageAttributeValue>) -> Result<Self> {
        let get = |name: &'static str| -> Result<String> {
            attributes
                .get(name)
                .and_then(|v| v.string_value())
                .map(str::to_string)
                .ok_or(Error::MissingAttribute { name })
        };
        let id = get(ATTR_EVENT_ID)?;
        let event_id = Uuid::parse_str(&id).map_err(|e| Error::InvalidAttribute {
            name: ATTR_EVENT_ID,
            reason: format!("{id:?} is not a UUID: {e}"),
        })?;
        let at = get(ATTR_CREATED_AT)?;
        let created_at = DateTime::parse_from_rfc3339(&at)
            .map_err(|e| Error::InvalidAttribute {
                name: ATTR_CREATED_AT,
                reason: format!("{at:?} is not an RFC 3339 time: {e}"),
            })?
            .with_timezone(&Utc);
        let mut headers = Headers::new();
        for (name, value) in attributes {
            if RESERVED.contains(&name.as_str()) {
                continue;
            }
            if let Some(text) = value.string_value() {
                headers.insert(name.clone(), text.to_string());
            }
        }
        if let Some(packed) = attributes.get(ATTR_HEADERS).and_then(|v| v.string_value()) {
            let object: HashMap<String, String> =
                serde_json::from_str(packed).map_err(|e| Error::InvalidAttribute {
                    name: ATTR_HEADERS,
                    reason: format!("not a JSON object of strings: {e}"),
                })?;
            headers.extend(object);
        }
        Ok(Self {
            event_id,
            event_type: get(ATTR_EVENT_TYPE)?,
            aggregate_type: get(ATTR_AGGREGATE_TYPE)?,
            aggregate_id: get(ATTR_AGGREGATE_ID)?,
            created_at,
            headers,
        })
    }

    /// The W3C `traceparent` header, when the producer recorded one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(TRACEPARENT).map(String::as_str)
    }
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
        Event {
            id: Uuid::now_v7(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "1".into(),
            event_type: "order.created".into(),
            payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            destination: None,
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    fn round_trip(e: &Event) -> Received {
        let attrs: HashMap<String, MessageAttributeValue> = attributes(e)
            .into_iter()
            .map(|(n, v)| (n, attribute_value(v).unwrap()))
            .collect();
        assert!(attrs.len() <= MAX_ATTRIBUTES, "{attrs:?}");
        Received::from_attributes(&attrs).unwrap()
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
