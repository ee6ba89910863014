//! The CloudEvents 1.0 envelope.
//!
//! An outbox event maps onto CloudEvents attributes as follows:
//!
//! | CloudEvents      | outbox event                                         |
//! |------------------|------------------------------------------------------|
//! | `specversion`    | `1.0`                                                |
//! | `id`             | the event id (the consumer's dedup key)              |
//! | `source`         | configured per publisher ([`CloudEvents::binary`])   |
//! | `type`           | the event type                                       |
//! | `time`           | the creation time, RFC 3339 in UTC                   |
//! | `subject`        | configured template, by default the aggregate id     |
//! | `aggregatetype`  | the aggregate type (extension attribute)             |
//! | `aggregateid`    | the aggregate id (extension attribute)               |
//! | `datacontenttype`| `application/json`                                   |
//! | `data`           | the event's JSON payload                             |
//!
//! In **binary** mode the attributes travel as headers named by the broker's
//! protocol binding ([`super::Binding`]: `ce_id` on Kafka, `ce-id` on NATS,
//! `cloudEvents:id` on AMQP) and the body is the payload. In **structured** mode the
//! body is the event in the JSON event format with content type
//! `application/cloudevents+json`. In both modes the event's own headers
//! (`traceparent`, user metadata) travel as plain headers, as with the outbox
//! envelope.

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::{own_headers, Binding, Encoded, EnvelopeError, Format, Metadata};
use crate::event::{Event, Headers};

/// The CloudEvents version written and accepted.
pub const SPEC_VERSION: &str = "1.0";
/// Content type of a structured-mode message (the JSON event format).
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
/// Content type of the payload.
pub const DATA_CONTENT_TYPE: &str = "application/json";
/// Extension attribute with the aggregate type.
pub const AGGREGATE_TYPE: &str = "aggregatetype";
/// Extension attribute with the aggregate id.
pub const AGGREGATE_ID: &str = "aggregateid";

/// How a CloudEvent travels: attributes as headers, or the whole event as the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ContentMode {
    /// Attributes as protocol headers, the payload as the body.
    #[default]
    Binary,
    /// The event in the JSON event format as the body.
    Structured,
}

/// The default subject template of [`CloudEvents`]: the aggregate id.
pub const DEFAULT_SUBJECT: &str = "{aggregate_id}";

/// The CloudEvents envelope's settings: content mode, `source`, `subject`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    mode: ContentMode,
    source: String,
    subject: Option<Template>,
}

/// An envelope setting is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeConfigError {
    /// An unknown envelope name.
    #[error("unknown envelope {0:?} (OUTBOX_ENVELOPE, envelope.format): expected `outbox`, `cloudevents-binary` or `cloudevents-structured`")]
    Unknown(String),
    /// A CloudEvents envelope without its `source`.
    #[error("the CloudEvents envelope needs a source (OUTBOX_CLOUDEVENTS_SOURCE, envelope.source): a URI reference naming the producer, e.g. `/orders-service`")]
    SourceMissing,
    /// `source` is empty or has characters a URI reference cannot hold.
    #[error("CloudEvents source {0:?} is not a URI reference (non-empty, no spaces or control characters), e.g. `/orders-service` or `urn:example:orders`")]
    Source(String),
    /// The subject template names an unknown placeholder or is malformed.
    #[error("CloudEvents subject template {template:?}: {reason} (placeholders: {{aggregate_type}}, {{aggregate_id}}, {{event_type}})")]
    Subject {
        /// The template.
        template: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An unknown content mode name.
    #[error("unknown CloudEvents content mode {0:?}: expected `binary` or `structured`")]
    Mode(String),
}

impl CloudEvents {
    /// Binary content mode with this `source` (a URI reference naming the producer,
    /// e.g. `/orders-service`); subject: the aggregate id.
    pub fn binary(source: impl Into<String>) -> Result<Self, EnvelopeConfigError> {
        Self::new(ContentMode::Binary, source)
    }

    /// Structured content mode with this `source`; subject: the aggregate id.
    pub fn structured(source: impl Into<String>) -> Result<Self, EnvelopeConfigError> {
        Self::new(ContentMode::Structured, source)
    }

    /// This content mode and `source`; subject: the aggregate id.
    pub fn new(mode: ContentMode, source: impl Into<String>) -> Result<Self, EnvelopeConfigError> {
        let source = source.into();
        let valid =
            !source.is_empty() && !source.chars().any(|c| c.is_whitespace() || c.is_control());
        if !valid {
            return Err(EnvelopeConfigError::Source(source));
        }
        Ok(Self {
            mode,
            source,
            subject: Some(Template::parse(DEFAULT_SUBJECT)?),
        })
    }

    /// The `subject` of each event from a template with `{aggregate_type}`,
    /// `{aggregate_id}` and `{event_type}` placeholders, e.g.
    /// `{aggregate_type}/{aggregate_id}`; an empty template sends no subject.
    pub fn subject(mut self, template: &str) -> Result<Self, EnvelopeConfigError> {
        self.subject = if template.is_empty() {
            None
        } else {
            Some(Template::parse(template)?)
        };
        Ok(self)
    }

    /// The content mode.
    pub fn mode(&self) -> ContentMode {
        self.mode
    }

    /// The `source` attribute.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub(super) fn encode<'a>(&self, event: &'a Event, binding: &Binding) -> Encoded<'a> {
        let subject = self.subject.as_ref().map(|t| t.render(event));
        let time = event
            .created_at
            .to_rfc3339_opts(SecondsFormat::Micros, true);
        match self.mode {
            ContentMode::Binary => {
                let prefix = binding.attribute_prefix;
                let name = |attribute: &str| Cow::Owned(format!("{prefix}{attribute}"));
                let mut metadata = vec![
                    (name("specversion"), Cow::Borrowed(SPEC_VERSION)),
                    (name("id"), Cow::Owned(event.id.to_string())),
                    (name("source"), Cow::Owned(self.source.clone())),
                    (name("type"), Cow::Borrowed(event.event_type.as_str())),
                    (name("time"), Cow::Owned(time)),
                ];
                if let Some(subject) = subject {
                    metadata.push((name("subject"), Cow::Owned(subject)));
                }
                metadata.push((
                    name(AGGREGATE_TYPE),
                    Cow::Borrowed(event.aggregate_type.as_str()),
                ));
                metadata.push((
                    name(AGGREGATE_ID),
                    Cow::Borrowed(event.aggregate_id.as_str()),
                ));
                Encoded {
                    metadata,
                    headers: own_headers(event, |n| is_attribute_header(binding, n)),
                    body: Cow::Borrowed(event.payload_str().as_bytes()),
                    content_type: Some(DATA_CONTENT_TYPE),
                }
            }
            ContentMode::Structured => {
                let document = Structured {
                    specversion: SPEC_VERSION.into(),
                    id: event.id.to_string(),
                    source: Cow::Borrowed(&self.source),
                    event_type: Cow::Borrowed(&event.event_type),
                    time: Some(time),
                    subject,
                    aggregatetype: Some(Cow::Borrowed(&event.aggregate_type)),
                    aggregateid: Some(Cow::Borrowed(&event.aggregate_id)),
                    datacontenttype: Some(DATA_CONTENT_TYPE.into()),
                    data: Some(&event.payload),
                };
                // Strings and an already valid JSON value: serialising cannot fail.
                let body = serde_json::to_vec(&document)
                    .unwrap_or_else(|e| unreachable!("a CloudEvent serialises to JSON: {e}"));
                Encoded {
                    metadata: Vec::new(),
                    headers: own_headers(event, |_| false),
                    body: Cow::Owned(body),
                    content_type: Some(STRUCTURED_CONTENT_TYPE),
                }
            }
        }
    }
}

impl std::str::FromStr for ContentMode {
    type Err = EnvelopeConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "binary" => Ok(ContentMode::Binary),
            "structured" => Ok(ContentMode::Structured),
            other => Err(EnvelopeConfigError::Mode(other.to_string())),
        }
    }
}

/// The JSON event format (structured mode), written and read.
#[derive(Serialize, Deserialize)]
struct Structured<'a> {
    specversion: Cow<'a, str>,
    id: String,
    source: Cow<'a, str>,
    #[serde(rename = "type")]
    event_type: Cow<'a, str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    aggregatetype: Option<Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    aggregateid: Option<Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    datacontenttype: Option<Cow<'a, str>>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    data: Option<&'a RawValue>,
}

/// True for a structured-mode content type (parameters such as `charset` ignored).
pub(super) fn is_structured(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|media| media.trim().eq_ignore_ascii_case(STRUCTURED_CONTENT_TYPE))
}

/// True for the header of a CloudEvents attribute under `binding`.
fn is_attribute_header(binding: &Binding, name: &str) -> bool {
    attribute_of(binding, name).is_some()
}

/// The attribute a header carries under `binding` (prefix compared without case).
fn attribute_of<'n>(binding: &Binding, name: &'n str) -> Option<&'n str> {
    let prefix = binding.attribute_prefix;
    (name.len() > prefix.len()
        && name.is_char_boundary(prefix.len())
        && name[..prefix.len()].eq_ignore_ascii_case(prefix))
    .then(|| &name[prefix.len()..])
}

/// True when the headers hold a binary-mode CloudEvent (its `specversion`).
pub(super) fn is_binary(binding: &Binding, pairs: &[(&str, &str)]) -> bool {
    pairs.iter().any(|(n, _)| {
        attribute_of(binding, n).is_some_and(|a| a.eq_ignore_ascii_case("specversion"))
    })
}

/// The metadata of a binary-mode CloudEvent: attributes from the prefixed headers
/// (the first of a repeated name wins), the other headers as the event's own.
pub(super) fn read_binary(
    binding: &Binding,
    pairs: Vec<(&str, &str)>,
) -> Result<Metadata, EnvelopeError> {
    let mut attributes = Headers::new();
    let mut headers = Headers::new();
    for (name, value) in pairs {
        let (map, key) = match attribute_of(binding, name) {
            Some(attribute) => (&mut attributes, attribute.to_ascii_lowercase()),
            None if super::is_reserved(name) => continue,
            None => (&mut headers, name.to_string()),
        };
        map.entry(key).or_insert_with(|| value.to_string());
    }
    let mut take = |name: &str| attributes.remove(name);
    let specversion = take("specversion").unwrap_or_default();
    metadata(
        Attributes {
            specversion: &specversion,
            id: take("id"),
            source: take("source"),
            event_type: take("type"),
            time: take("time"),
            subject: take("subject"),
            aggregate_type: take(AGGREGATE_TYPE),
            aggregate_id: take(AGGREGATE_ID),
        },
        headers,
        Format::CloudEventsBinary,
    )
}

/// The metadata of a structured-mode CloudEvent: attributes from the JSON body, the
/// protocol headers as the event's own.
pub(super) fn read_structured(
    pairs: Vec<(&str, &str)>,
    body: &[u8],
) -> Result<Metadata, EnvelopeError> {
    let document: Structured<'_> =
        serde_json::from_slice(body).map_err(|e| EnvelopeError::MalformedCloudEvent {
            what: "body",
            reason: e.to_string(),
        })?;
    let mut headers = Headers::new();
    for (name, value) in pairs {
        if !super::is_reserved(name) {
            headers
                .entry(name.to_string())
                .or_insert_with(|| value.to_string());
        }
    }
    metadata(
        Attributes {
            specversion: &document.specversion,
            id: Some(document.id),
            source: Some(document.source.into_owned()),
            event_type: Some(document.event_type.into_owned()),
            time: document.time,
            subject: document.subject,
            aggregate_type: document.aggregatetype.map(Cow::into_owned),
            aggregate_id: document.aggregateid.map(Cow::into_owned),
        },
        headers,
        Format::CloudEventsStructured,
    )
}

/// The payload of a structured-mode body: its `data` member, byte for byte.
pub(super) fn data(body: &[u8]) -> Result<&[u8], String> {
    #[derive(Deserialize)]
    struct Data<'a> {
        #[serde(borrow)]
        data: Option<&'a RawValue>,
    }
    let parsed: Data<'_> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    parsed
        .data
        .map(|raw| raw.get().as_bytes())
        .ok_or_else(|| "the CloudEvent has no `data` member".to_string())
}

/// The attributes the outbox reads, wherever they came from.
struct Attributes<'a> {
    specversion: &'a str,
    id: Option<String>,
    source: Option<String>,
    event_type: Option<String>,
    time: Option<String>,
    subject: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
}

fn metadata(
    a: Attributes<'_>,
    headers: Headers,
    format: Format,
) -> Result<Metadata, EnvelopeError> {
    if a.specversion != SPEC_VERSION {
        return Err(EnvelopeError::MalformedCloudEvent {
            what: "specversion",
            reason: format!("{:?} is not {SPEC_VERSION}", a.specversion),
        });
    }
    let id = a.id.ok_or(EnvelopeError::MissingAttribute("id"))?;
    let event_id = id
        .parse()
        .map_err(|e: uuid::Error| EnvelopeError::MalformedCloudEvent {
            what: "id",
            reason: format!("{id:?} is not a UUID: {e}"),
        })?;
    let created_at = a
        .time
        .map(|t| {
            DateTime::parse_from_rfc3339(&t)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| EnvelopeError::MalformedCloudEvent {
                    what: "time",
                    reason: format!("{t:?}: {e}"),
                })
        })
        .transpose()?;
    Ok(Metadata {
        event_id,
        event_type: a
            .event_type
            .ok_or(EnvelopeError::MissingAttribute("type"))?,
        aggregate_type: a
            .aggregate_type
            .ok_or(EnvelopeError::MissingAttribute(AGGREGATE_TYPE))?,
        aggregate_id: a
            .aggregate_id
            .ok_or(EnvelopeError::MissingAttribute(AGGREGATE_ID))?,
        created_at,
        headers,
        source: a.source,
        subject: a.subject,
        format,
    })
}

/// A subject template: literal text and placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Template(Vec<Piece>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    AggregateType,
    AggregateId,
    EventType,
}

impl Template {
    fn parse(template: &str) -> Result<Self, EnvelopeConfigError> {
        let error = |reason: String| EnvelopeConfigError::Subject {
            template: template.to_string(),
            reason,
        };
        let mut pieces = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_string()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| error("a `{` is not closed".into()))?;
            pieces.push(match &rest[open + 1..open + close] {
                "aggregate_type" => Piece::AggregateType,
                "aggregate_id" => Piece::AggregateId,
                "event_type" => Piece::EventType,
                other => return Err(error(format!("unknown placeholder {{{other}}}"))),
            });
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(error("a `}` has no `{`".into()));
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_string()));
        }
        Ok(Self(pieces))
    }

    fn render(&self, event: &Event) -> String {
        self.0
            .iter()
            .map(|piece| match piece {
                Piece::Text(text) => text.as_str(),
                Piece::AggregateType => &event.aggregate_type,
                Piece::AggregateId => &event.aggregate_id,
                Piece::EventType => &event.event_type,
            })
            .collect()
    }
}
