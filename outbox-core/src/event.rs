//! The event: what producers enqueue ([`NewEvent`]) and what the relay publishes ([`Event`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

/// Free-form string headers carried with an event to the broker (trace context, user metadata).
pub type Headers = BTreeMap<String, String>;

/// Header name of the W3C trace context, carried to every broker when present.
pub const TRACEPARENT: &str = "traceparent";

/// Longest aggregate type, aggregate id, event type or destination accepted, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// An event stored in the outbox and claimed by the relay for publishing.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Event {
    /// Unique id: the dedup key every broker message carries.
    pub id: Uuid,
    /// Insertion sequence assigned by the store; per-aggregate order follows it.
    pub seq: i64,
    /// Kind of aggregate the event belongs to, e.g. `order`.
    pub aggregate_type: String,
    /// Id of the aggregate instance, e.g. the order id.
    pub aggregate_id: String,
    /// What happened, e.g. `order.created`.
    pub event_type: String,
    /// The JSON payload, exactly as stored.
    pub payload: Box<RawValue>,
    /// Headers to carry to the broker (trace context, user metadata).
    pub headers: Headers,
    /// Optional destination override (topic, subject, queue) for the routing rule.
    pub destination: Option<String>,
    /// When the event was written.
    pub created_at: DateTime<Utc>,
    /// Publish attempts made before the current one.
    pub attempts: u32,
}

impl Event {
    /// An event as a store hands it to the relay, written at `created_at`: `seq` 0,
    /// no headers, no destination, no attempts yet. A store sets the other fields
    /// from its row (the struct is `#[non_exhaustive]`: fields may be added, so it
    /// is built with this and then assigned, not with a struct expression).
    pub fn new(
        id: Uuid,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Box<RawValue>,
        created_at: DateTime<Utc>,
    ) -> Self {
        Self {
            id,
            seq: 0,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: Headers::new(),
            destination: None,
            created_at,
            attempts: 0,
        }
    }

    /// The W3C `traceparent` header, when one was recorded.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(TRACEPARENT).map(String::as_str)
    }

    /// The payload as JSON text.
    pub fn payload_str(&self) -> &str {
        self.payload.get()
    }
}

/// A payload type that names its own event type, for [`NewEvent::typed`]; an enum
/// of a domain's events names one type per variant.
pub trait TypedEvent: Serialize {
    /// The event type of this value, e.g. `order.created`.
    fn event_type(&self) -> &str;
}

/// An event to enqueue in the caller's transaction.
///
/// Built with [`NewEvent::new`] (a JSON value, always valid) or
/// [`NewEvent::from_json_str`] (raw JSON text, validated by [`NewEvent::validate`],
/// which every store calls before writing anything).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct NewEvent {
    /// Event id; defaults to a fresh time-ordered UUID (v7).
    pub id: Uuid,
    /// Kind of aggregate, e.g. `order`.
    pub aggregate_type: String,
    /// Id of the aggregate instance.
    pub aggregate_id: String,
    /// What happened, e.g. `order.created`.
    pub event_type: String,
    /// JSON text of the payload.
    pub payload: String,
    /// Headers to carry to the broker.
    pub headers: Headers,
    /// Optional destination override for the routing rule.
    pub destination: Option<String>,
    /// Publish no earlier than this instant (delayed delivery). `None`: at once.
    pub not_before: Option<DateTime<Utc>>,
}

impl NewEvent {
    /// A new event with a JSON value as payload.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: &serde_json::Value,
    ) -> Self {
        Self::from_json_str(
            aggregate_type,
            aggregate_id,
            event_type,
            payload.to_string(),
        )
    }

    /// A new event with raw JSON text as payload; the text is validated at enqueue.
    pub fn from_json_str(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<String>,
    ) -> Self {
        Self {
            id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            headers: Headers::new(),
            destination: None,
            not_before: None,
        }
    }

    /// A new event whose payload is `payload` serialised as JSON (any
    /// `T: Serialize`). Fails, naming the event id and type, when `T`'s
    /// serialisation fails (e.g. a map with non-string keys).
    ///
    /// ```
    /// #[derive(serde::Serialize)]
    /// struct OrderCreated { order_id: u64, total_cents: i64 }
    ///
    /// let event = pgoutbox_core::NewEvent::serialize(
    ///     "order", "42", "order.created", &OrderCreated { order_id: 42, total_cents: 1999 },
    /// )?;
    /// assert_eq!(event.payload, r#"{"order_id":42,"total_cents":1999}"#);
    /// # Ok::<(), pgoutbox_core::EventError>(())
    /// ```
    pub fn serialize<T: Serialize + ?Sized>(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: &T,
    ) -> Result<Self, EventError> {
        let mut event = Self::from_json_str(aggregate_type, aggregate_id, event_type, "");
        event.payload =
            serde_json::to_string(payload).map_err(|e| EventError::UnserializablePayload {
                event_id: event.id,
                event_type: event.event_type.clone(),
                reason: e.to_string(),
            })?;
        Ok(event)
    }

    /// A new event from a payload that names its own event type ([`TypedEvent`]).
    ///
    /// ```
    /// #[derive(serde::Serialize)]
    /// #[serde(tag = "kind")]
    /// enum OrderEvent { Created { total_cents: i64 }, Cancelled }
    ///
    /// impl pgoutbox_core::TypedEvent for OrderEvent {
    ///     fn event_type(&self) -> &str {
    ///         match self {
    ///             OrderEvent::Created { .. } => "order.created",
    ///             OrderEvent::Cancelled => "order.cancelled",
    ///         }
    ///     }
    /// }
    ///
    /// let event = pgoutbox_core::NewEvent::typed("order", "42", &OrderEvent::Cancelled)?;
    /// assert_eq!(event.event_type, "order.cancelled");
    /// # Ok::<(), pgoutbox_core::EventError>(())
    /// ```
    pub fn typed<T: TypedEvent + ?Sized>(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        payload: &T,
    ) -> Result<Self, EventError> {
        Self::serialize(
            aggregate_type,
            aggregate_id,
            payload.event_type().to_owned(),
            payload,
        )
    }

    /// Use this id instead of a generated one (e.g. to make the enqueue idempotent).
    #[must_use]
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = id;
        self
    }

    /// Add a header carried to the broker.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Record the W3C trace context so consumers can continue the trace.
    #[must_use]
    pub fn with_traceparent(self, traceparent: impl Into<String>) -> Self {
        self.with_header(TRACEPARENT, traceparent)
    }

    /// Route to this destination (topic, subject, queue) instead of the routing rule's default.
    #[must_use]
    pub fn with_destination(mut self, destination: impl Into<String>) -> Self {
        self.destination = Some(destination.into());
        self
    }

    /// Publish no earlier than `at` (delayed delivery).
    #[must_use]
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// Check everything a store needs before writing: names present and bounded,
    /// payload valid JSON that PostgreSQL `jsonb` accepts, header names present.
    pub fn validate(&self) -> Result<(), EventError> {
        check_name("aggregate_type", &self.aggregate_type)?;
        check_name("aggregate_id", &self.aggregate_id)?;
        check_name("event_type", &self.event_type)?;
        if let Some(destination) = &self.destination {
            check_name("destination", destination)?;
        }
        if self.headers.keys().any(|k| k.is_empty()) {
            return Err(EventError::EmptyHeaderName { event_id: self.id });
        }
        if let Err(source) = serde_json::from_str::<serde::de::IgnoredAny>(&self.payload) {
            return Err(EventError::InvalidPayload {
                event_id: self.id,
                event_type: self.event_type.clone(),
                reason: source.to_string(),
            });
        }
        // jsonb cannot store the NUL character; refuse it here with a clear error.
        if self.payload.contains("\\u0000") {
            return Err(EventError::InvalidPayload {
                event_id: self.id,
                event_type: self.event_type.clone(),
                reason: "contains \\u0000, which PostgreSQL jsonb cannot store".into(),
            });
        }
        Ok(())
    }
}

fn check_name(field: &'static str, value: &str) -> Result<(), EventError> {
    if value.trim().is_empty() {
        return Err(EventError::EmptyField { field });
    }
    if value.len() > MAX_NAME_LEN {
        return Err(EventError::FieldTooLong {
            field,
            len: value.len(),
        });
    }
    if value.contains('\0') {
        return Err(EventError::NulInField { field });
    }
    Ok(())
}

/// Why an event was refused before anything was written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventError {
    /// A required field is empty.
    #[error("event field `{field}` is empty")]
    EmptyField {
        /// The field.
        field: &'static str,
    },
    /// A field is longer than [`MAX_NAME_LEN`].
    #[error("event field `{field}` is {len} bytes long; the limit is {MAX_NAME_LEN}")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// A field contains a NUL character.
    #[error("event field `{field}` contains a NUL character")]
    NulInField {
        /// The field.
        field: &'static str,
    },
    /// A header has an empty name.
    #[error("event {event_id} has a header with an empty name")]
    EmptyHeaderName {
        /// The event.
        event_id: Uuid,
    },
    /// The payload value could not be serialised as JSON.
    #[error("payload of event {event_id} ({event_type}) cannot be serialised as JSON: {reason}")]
    UnserializablePayload {
        /// The event.
        event_id: Uuid,
        /// Its type, to find the producer.
        event_type: String,
        /// What the serialiser said.
        reason: String,
    },
    /// The payload is not valid JSON (or not storable as jsonb).
    #[error("payload of event {event_id} ({event_type}) is not valid JSON: {reason}")]
    InvalidPayload {
        /// The event.
        event_id: Uuid,
        /// Its type, to find the producer.
        event_type: String,
        /// What the JSON parser said.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_event_passes() {
        let e = NewEvent::new("order", "1", "order.created", &serde_json::json!({"a": 1}));
        assert_eq!(e.validate(), Ok(()));
    }

    #[test]
    fn a_value_that_cannot_be_json_is_refused_naming_the_event() {
        // JSON object keys must be strings; a map keyed by tuples has none.
        let payload: BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        let err = NewEvent::serialize("order", "1", "order.created", &payload).unwrap_err();
        let EventError::UnserializablePayload {
            event_type, reason, ..
        } = &err
        else {
            panic!("wrong error: {err:?}");
        };
        assert_eq!(event_type, "order.created");
        assert!(reason.contains("key must be a string"), "{reason}");
        assert!(err.to_string().contains("(order.created)"), "{err}");
    }

    #[test]
    fn a_typed_event_names_its_own_type_and_passes_validation() {
        #[derive(Serialize)]
        #[serde(tag = "kind")]
        enum OrderEvent {
            Created { total_cents: i64 },
            Cancelled,
        }
        impl TypedEvent for OrderEvent {
            fn event_type(&self) -> &str {
                match self {
                    OrderEvent::Created { .. } => "order.created",
                    OrderEvent::Cancelled => "order.cancelled",
                }
            }
        }
        let created = NewEvent::typed("order", "7", &OrderEvent::Created { total_cents: 5 })
            .expect("serialisable");
        assert_eq!(created.event_type, "order.created");
        assert_eq!(created.payload, r#"{"kind":"Created","total_cents":5}"#);
        assert_eq!(created.validate(), Ok(()));
        let cancelled = NewEvent::typed("order", "7", &OrderEvent::Cancelled).expect("ok");
        assert_eq!(cancelled.event_type, "order.cancelled");
    }

    #[test]
    fn invalid_json_is_named() {
        let e = NewEvent::from_json_str("order", "1", "order.created", "{not json");
        let err = e.validate().unwrap_err();
        assert!(matches!(err, EventError::InvalidPayload { .. }));
        assert!(err.to_string().contains("not valid JSON"), "{err}");
    }

    #[test]
    fn nul_escape_is_refused() {
        let e = NewEvent::from_json_str("order", "1", "t", r#"{"a":"\u0000"}"#);
        assert!(matches!(
            e.validate(),
            Err(EventError::InvalidPayload { .. })
        ));
    }

    #[test]
    fn empty_names_are_refused() {
        let e = NewEvent::new("", "1", "t", &serde_json::Value::Null);
        assert_eq!(
            e.validate(),
            Err(EventError::EmptyField {
                field: "aggregate_type"
            })
        );
        let e = NewEvent::new("order", "1", "t", &serde_json::Value::Null).with_header("", "x");
        assert!(matches!(
            e.validate(),
            Err(EventError::EmptyHeaderName { .. })
        ));
    }
}
