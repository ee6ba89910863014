//! The message envelope every broker adapter uses: how an event becomes headers and
//! a body ([`Envelope::encode`]), and how a consumer reads the metadata back
//! ([`Metadata::from_message`]).
//!
//! Two envelopes ship:
//! - [`Envelope::Outbox`] (the default): the body is the event's JSON payload, the
//!   metadata travels in `outbox-*` headers ([`RESERVED`]).
//! - [`Envelope::CloudEvents`]: [CloudEvents 1.0](https://cloudevents.io), in binary
//!   mode (attributes as headers named by the broker's protocol binding, the payload
//!   as the body) or structured mode (one JSON document, `application/cloudevents+json`);
//!   see [`cloudevents`].
//!
//! Brokers differ in where headers go (NATS headers, AMQP header table, Kafka record
//! headers, SQS message attributes) and in the prefix their CloudEvents binding gives
//! attribute headers: each adapter describes that with a [`Binding`]. A consumer
//! reads any envelope from any broker into the one [`Metadata`] type, without
//! knowing which envelope the producer chose.

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::event::{Event, Headers};

pub mod cloudevents;

pub use cloudevents::{CloudEvents, ContentMode, EnvelopeConfigError};

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

/// The outbox envelope's metadata of `event`, in [`RESERVED`] order.
fn outbox_metadata(event: &Event) -> Vec<(Cow<'static, str>, Cow<'_, str>)> {
    vec![
        (EVENT_ID.into(), Cow::Owned(event.id.to_string())),
        (EVENT_TYPE.into(), Cow::Borrowed(event.event_type.as_str())),
        (
            AGGREGATE_TYPE.into(),
            Cow::Borrowed(event.aggregate_type.as_str()),
        ),
        (
            AGGREGATE_ID.into(),
            Cow::Borrowed(event.aggregate_id.as_str()),
        ),
        (
            CREATED_AT.into(),
            Cow::Owned(
                event
                    .created_at
                    .to_rfc3339_opts(SecondsFormat::Micros, true),
            ),
        ),
    ]
}

/// The event's own headers (`traceparent`, user metadata), leaving out names any
/// envelope reserves ([`RESERVED`]) and those `taken` says the chosen envelope
/// uses: a user header never spoofs metadata.
fn own_headers(event: &Event, taken: impl Fn(&str) -> bool) -> Vec<(&str, &str)> {
    let mut out = Vec::with_capacity(event.headers.len());
    for (name, value) in &event.headers {
        if is_reserved(name) || taken(name) {
            tracing::debug!(event_id = %event.id, header = %name, "header name reserved by the envelope; not sent");
            continue;
        }
        out.push((name.as_str(), value.as_str()));
    }
    out
}

/// How the relay turns an event into a message: chosen in each adapter's config,
/// the same for every event of a publisher.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Envelope {
    /// The body is the event's JSON payload; id, type, aggregate and creation time
    /// travel in `outbox-*` headers, followed by the event's own headers.
    #[default]
    Outbox,
    /// A CloudEvents 1.0 event, in binary or structured content mode.
    CloudEvents(CloudEvents),
}

/// What a broker's protocol binding says about headers: the prefix of CloudEvents
/// attribute headers in binary mode, and the header that carries the content type
/// when the protocol has no property of its own for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Binding {
    /// Prefix of a CloudEvents attribute's header (`ce_` for Kafka, `ce-` for NATS,
    /// `cloudEvents:` for AMQP).
    pub attribute_prefix: &'static str,
    /// The header with the content type (`content-type`), or `None` when the
    /// protocol carries it as a message property (AMQP) that the adapter passes
    /// to [`Metadata::from_message`] itself.
    pub content_type_header: Option<&'static str>,
}

impl Binding {
    /// A binding with this attribute prefix and content-type header.
    pub const fn new(
        attribute_prefix: &'static str,
        content_type_header: Option<&'static str>,
    ) -> Self {
        Self {
            attribute_prefix,
            content_type_header,
        }
    }
}

/// An event encoded by an [`Envelope`]: what an adapter sends.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Encoded<'a> {
    /// The envelope's own headers (the outbox metadata, or CloudEvents attributes
    /// in binary mode), in a fixed order.
    pub metadata: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    /// The event's own headers (`traceparent`, user metadata), sent under their
    /// names in every envelope; names the envelope uses are left out.
    pub headers: Vec<(&'a str, &'a str)>,
    /// The message body.
    pub body: Cow<'a, [u8]>,
    /// The body's content type when the envelope names one: `application/json`
    /// for a CloudEvent in binary mode, `application/cloudevents+json` in
    /// structured mode; `None` for the outbox envelope (its body is always the
    /// JSON payload; adapters whose protocol has a content-type property set
    /// `application/json` there, as they always did).
    pub content_type: Option<&'static str>,
}

impl Encoded<'_> {
    /// Metadata then the event's headers, as name/value pairs.
    pub fn all_headers(&self) -> impl Iterator<Item = (&str, &str)> {
        self.metadata
            .iter()
            .map(|(n, v)| (n.as_ref(), v.as_ref()))
            .chain(self.headers.iter().copied())
    }
}

impl Envelope {
    /// Encode `event` for a broker whose protocol binding is `binding`.
    pub fn encode<'a>(&self, event: &'a Event, binding: &Binding) -> Encoded<'a> {
        match self {
            Envelope::Outbox => Encoded {
                metadata: outbox_metadata(event),
                headers: own_headers(event, |_| false),
                body: Cow::Borrowed(event.payload_str().as_bytes()),
                content_type: None,
            },
            Envelope::CloudEvents(ce) => ce.encode(event, binding),
        }
    }

    /// The envelope named `name` (`outbox`, `cloudevents-binary`,
    /// `cloudevents-structured`); a CloudEvents one needs `source` and takes an
    /// optional `subject` template ([`CloudEvents::subject`]).
    pub fn from_settings(
        name: &str,
        source: Option<&str>,
        subject: Option<&str>,
    ) -> Result<Self, EnvelopeConfigError> {
        let mode = match name.trim() {
            "outbox" => return Ok(Envelope::Outbox),
            "cloudevents-binary" => ContentMode::Binary,
            "cloudevents-structured" => ContentMode::Structured,
            other => return Err(EnvelopeConfigError::Unknown(other.to_string())),
        };
        let source = source.ok_or(EnvelopeConfigError::SourceMissing)?;
        let config = CloudEvents::new(mode, source)?;
        Ok(Envelope::CloudEvents(match subject {
            Some(template) => config.subject(template)?,
            None => config,
        }))
    }

    /// The envelope the environment names, read by every adapter's `from_env`:
    /// [`VAR_ENVELOPE`] (default `outbox`), [`VAR_CLOUDEVENTS_SOURCE`],
    /// [`VAR_CLOUDEVENTS_SUBJECT`]. Unset or empty variables keep the default.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self, EnvelopeConfigError> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        match var(VAR_ENVELOPE) {
            None => Ok(Envelope::Outbox),
            Some(name) => Self::from_settings(
                &name,
                var(VAR_CLOUDEVENTS_SOURCE).as_deref(),
                var(VAR_CLOUDEVENTS_SUBJECT).as_deref(),
            ),
        }
    }
}

/// Environment variable naming the envelope: `outbox` (default),
/// `cloudevents-binary` or `cloudevents-structured`.
pub const VAR_ENVELOPE: &str = "OUTBOX_ENVELOPE";
/// Environment variable with the CloudEvents `source` (required for CloudEvents).
pub const VAR_CLOUDEVENTS_SOURCE: &str = "OUTBOX_CLOUDEVENTS_SOURCE";
/// Environment variable with the CloudEvents `subject` template (default
/// `{aggregate_id}`).
pub const VAR_CLOUDEVENTS_SUBJECT: &str = "OUTBOX_CLOUDEVENTS_SUBJECT";

/// Which envelope a received message came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// `outbox-*` headers, the payload as the body.
    Outbox,
    /// A CloudEvent in binary content mode: attributes in headers, the payload as
    /// the body.
    CloudEventsBinary,
    /// A CloudEvent in structured content mode: the body is the event as JSON, the
    /// payload its `data` member.
    CloudEventsStructured,
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
    /// The CloudEvents `source`; `None` for the outbox envelope.
    pub source: Option<String>,
    /// The CloudEvents `subject`, when the producer set one.
    pub subject: Option<String>,
    /// The envelope the message came in: [`Metadata::payload`] and
    /// [`Metadata::decode`] read the body accordingly.
    pub format: Format,
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
    /// A CloudEvent lacks an attribute the outbox needs (`id`, `type`, and the
    /// `aggregatetype`/`aggregateid` extensions the outbox always sends).
    #[error("CloudEvent has no `{0}` attribute: not published by the outbox?")]
    MissingAttribute(&'static str),
    /// A CloudEvent's attribute or body does not parse.
    #[error("CloudEvent {what} is malformed: {reason}")]
    MalformedCloudEvent {
        /// The attribute (`id`, `time`, `specversion`) or `body`.
        what: &'static str,
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
    /// Read the event's payload out of `body` (the message's body) as `T`.
    pub fn decode<T: DeserializeOwned>(&self, body: &[u8]) -> Result<T, DecodeError> {
        decode(self.event_id, &self.event_type, self.payload(body)?)
    }

    /// The event's JSON payload, byte for byte, out of the message's `body`: the
    /// body itself, or its `data` member for a structured CloudEvent.
    pub fn payload<'b>(&self, body: &'b [u8]) -> Result<&'b [u8], DecodeError> {
        match self.format {
            Format::CloudEventsStructured => {
                cloudevents::data(body).map_err(|reason| DecodeError {
                    event_id: self.event_id,
                    event_type: self.event_type.clone(),
                    target: "a structured CloudEvent",
                    reason,
                })
            }
            _ => Ok(body),
        }
    }

    /// Read the metadata of a received message in any [`Envelope`]: a structured
    /// CloudEvent when the content type says so, a binary one when the headers hold
    /// its `specversion` under the binding's prefix, the outbox envelope otherwise.
    ///
    /// `content_type` is the message's content-type property for a protocol that
    /// has one (AMQP); pass `None` and the binding's content-type header is read.
    /// Headers that are not metadata end up in [`Metadata::headers`].
    pub fn from_message<'a>(
        binding: &Binding,
        headers: impl IntoIterator<Item = (&'a str, &'a str)>,
        content_type: Option<&'a str>,
        body: &[u8],
    ) -> Result<Self, EnvelopeError> {
        let mut pairs: Vec<(&str, &str)> = headers.into_iter().collect();
        let mut content_type = content_type;
        if let Some(header) = binding.content_type_header {
            if let Some(i) = pairs
                .iter()
                .position(|(n, _)| n.eq_ignore_ascii_case(header))
            {
                let (_, value) = pairs.remove(i);
                content_type.get_or_insert(value);
            }
        }
        if content_type.is_some_and(cloudevents::is_structured) {
            return cloudevents::read_structured(pairs, body);
        }
        if cloudevents::is_binary(binding, &pairs) {
            return cloudevents::read_binary(binding, pairs);
        }
        Self::from_headers(pairs)
    }

    /// Read the outbox envelope's metadata from a message's header pairs (names compared without case;
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
            source: None,
            subject: None,
            format: Format::Outbox,
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

    const BINDING: Binding = Binding::new("ce_", Some("content-type"));

    /// Encode `e`, then read it back as a consumer does (through `BINDING`).
    fn round_trip(envelope: &Envelope, e: &Event) -> (Metadata, Vec<u8>) {
        let encoded = envelope.encode(e, &BINDING);
        let mut pairs: Vec<(&str, &str)> = encoded.all_headers().collect();
        if let Some(content_type) = encoded.content_type {
            pairs.push(("content-type", content_type));
        }
        let meta = Metadata::from_message(&BINDING, pairs, None, &encoded.body).expect("metadata");
        let payload = meta.payload(&encoded.body).expect("payload").to_vec();
        (meta, payload)
    }

    #[test]
    fn every_envelope_round_trips_and_reserved_names_cannot_be_spoofed() {
        let mut e = event();
        e.headers.insert("ce_id".into(), "spoof".into());
        let envelopes = [
            (Envelope::Outbox, Format::Outbox),
            (
                Envelope::CloudEvents(CloudEvents::binary("/orders").unwrap()),
                Format::CloudEventsBinary,
            ),
            (
                Envelope::CloudEvents(CloudEvents::structured("/orders").unwrap()),
                Format::CloudEventsStructured,
            ),
        ];
        for (envelope, format) in envelopes {
            let (meta, payload) = round_trip(&envelope, &e);
            assert_eq!(meta.format, format);
            assert_eq!(meta.event_id, e.id, "{format:?}");
            assert_eq!(meta.event_type, "order.created");
            assert_eq!(
                (meta.aggregate_type.as_str(), meta.aggregate_id.as_str()),
                ("order", "42")
            );
            assert_eq!(
                meta.created_at.map(|t| t.timestamp_micros()),
                Some(e.created_at.timestamp_micros())
            );
            assert_eq!(payload, e.payload_str().as_bytes());
            assert_eq!(meta.traceparent(), Some("00-abc-def-01"));
            assert!(!meta.headers.contains_key(EVENT_ID), "{format:?}");
            assert!(!meta.headers.contains_key("content-type"), "{format:?}");
            let cloudevent = format != Format::Outbox;
            assert_eq!(meta.source.as_deref(), cloudevent.then_some("/orders"));
            assert_eq!(meta.subject.as_deref(), cloudevent.then_some("42"));
            // A user header named like a binary-mode attribute is not sent there.
            // A user header named like the envelope's id header is not sent.
            let encoded = envelope.encode(&e, &BINDING);
            let (id_header, expected) = match format {
                Format::CloudEventsBinary => ("ce_id", 1),
                Format::CloudEventsStructured => (EVENT_ID, 0),
                _ => (EVENT_ID, 1),
            };
            let ids = encoded
                .all_headers()
                .filter(|(n, _)| *n == id_header)
                .count();
            assert_eq!(ids, expected, "{format:?}");
        }
        // The outbox envelope is unchanged on the wire: the payload as the body and
        // the five `outbox-*` headers first.
        let encoded = Envelope::Outbox.encode(&e, &BINDING);
        assert_eq!(encoded.body.as_ref(), e.payload_str().as_bytes());
        let names: Vec<&str> = encoded.metadata.iter().map(|(n, _)| n.as_ref()).collect();
        assert_eq!(names, RESERVED);
        assert_eq!(encoded.content_type, None);
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
