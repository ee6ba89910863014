//! The message envelope every broker adapter uses: the metadata header names, the
//! headers of an event, and reading the metadata back on the consumer side.
//!
//! Brokers differ in where headers go (NATS headers, AMQP header table, Kafka record
//! headers, SQS message attributes) but carry the same names and values, so a
//! consumer reads any of them with [`Metadata::from_headers`].

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::event::{Event, Headers};

/// Header with the event id: the consumer's dedup key.
pub const EVENT_ID: &str = "outbox-event-id";
/// Header with the event type.
pub const EVENT_TYPE: &str = "outbox-event-type";
/// Header with the aggregate type.
pub const AGGREGATE_TYPE: &str = "outbox-aggregate-type";
/// Header with the aggregate id.
pub const AGGREGATE_ID: &str = "outbox-aggregate-id";
/// Header with the event's creation time, RFC 3339 in UTC.
pub const CREATED_AT: &str = "outbox-created-at";

/// The metadata names; user headers with these names (any case) are not sent.
pub const RESERVED: [&str; 5] = [
    EVENT_ID,
    EVENT_TYPE,
    AGGREGATE_TYPE,
    AGGREGATE_ID,
    CREATED_AT,
];

/// True for a header name the envelope sets itself (compared without case).
pub fn is_reserved(name: &str) -> bool {
    RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name))
}

/// The headers of `event`: the metadata first, then the event's own headers
/// (`traceparent`, user metadata), leaving out user headers with reserved names.
pub fn headers(event: &Event) -> Vec<(&str, Cow<'_, str>)> {
    let mut out = Vec::with_capacity(RESERVED.len() + event.headers.len());
    out.push((EVENT_ID, Cow::Owned(event.id.to_string())));
    out.push((EVENT_TYPE, Cow::Borrowed(event.event_type.as_str())));
    out.push((AGGREGATE_TYPE, Cow::Borrowed(event.aggregate_type.as_str())));
    out.push((AGGREGATE_ID, Cow::Borrowed(event.aggregate_id.as_str())));
    out.push((
        CREATED_AT,
        Cow::Owned(
            event
                .created_at
                .to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
    ));
    for (name, value) in &event.headers {
        if is_reserved(name) {
            tracing::debug!(event_id = %event.id, header = %name, "reserved header name; not sent");
            continue;
        }
        out.push((name.as_str(), Cow::Borrowed(value.as_str())));
    }
    out
}

/// The outbox metadata of a received message, whatever the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metadata {
    /// The event id: record it in the consumer's inbox to skip duplicates.
    pub event_id: Uuid,
    /// The event type.
    pub event_type: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// When the event was written to the outbox; `None` when the message does not
    /// say (the outbox always sends it; a message relayed by another tool may not).
    pub created_at: Option<DateTime<Utc>>,
    /// The event's own headers: `traceparent` and user metadata.
    pub headers: Headers,
}

/// A received message lacks outbox metadata or carries a malformed value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// A metadata header is missing.
    #[error("message has no `{0}` header: not published by the outbox?")]
    Missing(&'static str),
    /// A metadata header has a value that does not parse.
    #[error("message header `{name}` is malformed: {reason}")]
    Malformed {
        /// The header.
        name: &'static str,
        /// Why it does not parse.
        reason: String,
    },
}

/// A received message's body does not decode as the type the consumer asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("event {event_id} ({event_type}): body does not decode as `{target}`: {reason}")]
#[non_exhaustive]
pub struct DecodeError {
    /// The event.
    pub event_id: Uuid,
    /// Its type.
    pub event_type: String,
    /// The Rust type asked for.
    pub target: &'static str,
    /// What the JSON parser said (line and column included).
    pub reason: String,
}

/// Read a message body (the event's JSON payload) as `T`; an error names the event
/// id and type, and the type asked for. Every adapter's consumer metadata has a
/// `decode` method that calls this with its own id and type.
pub fn decode<T: DeserializeOwned>(
    event_id: Uuid,
    event_type: &str,
    body: &[u8],
) -> Result<T, DecodeError> {
    serde_json::from_slice(body).map_err(|e| DecodeError {
        event_id,
        event_type: event_type.to_owned(),
        target: std::any::type_name::<T>(),
        reason: e.to_string(),
    })
}

impl Metadata {
    /// Read `body` (the message's payload) as `T`.
    pub fn decode<T: DeserializeOwned>(&self, body: &[u8]) -> Result<T, DecodeError> {
        decode(self.event_id, &self.event_type, body)
    }

    /// Read the metadata from a message's header pairs (names compared without case;
    /// for a repeated name the first value wins). Headers not in [`RESERVED`] are kept
    /// in [`Metadata::headers`].
    pub fn from_headers<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, EnvelopeError> {
        let mut found: [Option<&str>; 5] = [None; 5];
        let mut headers = Headers::new();
        for (name, value) in pairs {
            match RESERVED.iter().position(|r| r.eq_ignore_ascii_case(name)) {
                Some(i) => {
                    found[i].get_or_insert(value);
                }
                None => {
                    headers
                        .entry(name.to_string())
                        .or_insert_with(|| value.to_string());
                }
            }
        }
        let get = |i: usize| found[i].ok_or(EnvelopeError::Missing(RESERVED[i]));
        let event_id = get(0)?
            .parse()
            .map_err(|e: uuid::Error| EnvelopeError::Malformed {
                name: EVENT_ID,
                reason: e.to_string(),
            })?;
        let created_at = found[4]
            .map(|t| {
                DateTime::parse_from_rfc3339(t).map_err(|e| EnvelopeError::Malformed {
                    name: CREATED_AT,
                    reason: e.to_string(),
                })
            })
            .transpose()?
            .map(|t| t.with_timezone(&Utc));
        Ok(Self {
            event_id,
            event_type: get(1)?.to_string(),
            aggregate_type: get(2)?.to_string(),
            aggregate_id: get(3)?.to_string(),
            created_at,
            headers,
        })
    }

    /// The W3C `traceparent` header, when the producer recorded one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(crate::TRACEPARENT).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> Event {
        Event {
            id: Uuid::now_v7(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            event_type: "order.created".into(),
            payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            headers: [
                ("traceparent".to_string(), "00-abc-def-01".to_string()),
                (EVENT_ID.to_string(), "spoof".to_string()),
            ]
            .into_iter()
            .collect(),
            destination: None,
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    #[test]
    fn a_body_decodes_as_the_type_asked_for_or_names_the_event() {
        #[derive(Debug, PartialEq, serde::Deserialize)]
        struct OrderCreated {
            total_cents: i64,
        }
        let meta = Metadata::from_headers([
            (EVENT_ID, "0190a0a0-0000-7000-8000-000000000001"),
            (EVENT_TYPE, "order.created"),
            (AGGREGATE_TYPE, "order"),
            (AGGREGATE_ID, "42"),
        ])
        .expect("metadata");
        let ok: OrderCreated = meta.decode(br#"{"total_cents": 1999}"#).expect("decodes");
        assert_eq!(ok, OrderCreated { total_cents: 1999 });

        let err = meta
            .decode::<OrderCreated>(br#"{"total_cents": "free"}"#)
            .unwrap_err();
        assert_eq!(err.event_id, meta.event_id);
        assert_eq!(err.event_type, "order.created");
        assert!(err.target.ends_with("OrderCreated"), "{}", err.target);
        let text = err.to_string();
        assert!(
            text.contains("0190a0a0-0000-7000-8000-000000000001")
                && text.contains("order.created")
                && text.contains("invalid type"),
            "{text}"
        );
    }

    #[test]
    fn headers_round_trip_and_reserved_names_cannot_be_spoofed() {
        let e = event();
        let pairs = headers(&e);
        assert_eq!(pairs.iter().filter(|(n, _)| *n == EVENT_ID).count(), 1);
        let meta = Metadata::from_headers(pairs.iter().map(|(n, v)| (*n, v.as_ref()))).unwrap();
        assert_eq!(meta.event_id, e.id);
        assert_eq!(meta.event_type, "order.created");
        assert_eq!(
            (meta.aggregate_type.as_str(), meta.aggregate_id.as_str()),
            ("order", "42")
        );
        assert_eq!(
            meta.created_at.map(|t| t.timestamp_micros()),
            Some(e.created_at.timestamp_micros())
        );
        assert_eq!(meta.traceparent(), Some("00-abc-def-01"));
        assert!(!meta.headers.contains_key(EVENT_ID));
    }

    #[test]
    fn names_are_case_insensitive_and_errors_name_the_header() {
        let id = Uuid::now_v7().to_string();
        let pairs = [
            ("Outbox-Event-Id", id.as_str()),
            ("OUTBOX-EVENT-TYPE", "t"),
            ("outbox-aggregate-type", "a"),
            ("outbox-aggregate-id", "1"),
            ("outbox-created-at", "2026-01-01T00:00:00Z"),
        ];
        assert!(Metadata::from_headers(pairs).is_ok());
        // The creation time is optional; the other four are not.
        let undated = Metadata::from_headers(pairs[..4].iter().copied()).unwrap();
        assert_eq!(undated.created_at, None);
        assert_eq!(
            Metadata::from_headers(pairs[1..].iter().copied()),
            Err(EnvelopeError::Missing(EVENT_ID))
        );
        let mut bad = pairs;
        bad[4].1 = "yesterday";
        assert!(matches!(
            Metadata::from_headers(bad),
            Err(EnvelopeError::Malformed {
                name: CREATED_AT,
                ..
            })
        ));
    }
}
