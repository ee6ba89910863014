//! The WAL message format: one JSON object per event, under a prefix naming the outbox.

use chrono::{DateTime, Utc};
use pgoutbox_core::{Event, Headers, NewEvent};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::tables::Tables;

/// Version of the message format, the `v` member of every message.
pub const FORMAT_VERSION: u32 = 1;

/// One event as a logical message's content:
///
/// ```json
/// {"v":1,"id":"0190...","aggregate_type":"order","aggregate_id":"42",
///  "event_type":"order.created","payload":{...},"headers":{"traceparent":"00-..."},
///  "destination":null,"created_at":"2026-12-04T10:00:00.000001Z"}
/// ```
///
/// The prefix is `pgoutbox:<schema>.<events_table>` ([`WalMessage::prefix`]), so
/// that several outboxes share a database and a relay reads only its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WalMessage {
    /// [`FORMAT_VERSION`].
    pub v: u32,
    /// The event id: the consumer's dedup key.
    pub id: Uuid,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id: events of one aggregate are published in commit order.
    pub aggregate_id: String,
    /// The event type.
    pub event_type: String,
    /// The JSON payload, byte for byte.
    pub payload: Box<RawValue>,
    /// `traceparent` and user metadata.
    #[serde(default)]
    pub headers: Headers,
    /// A destination overriding the publisher's routing.
    #[serde(default)]
    pub destination: Option<String>,
    /// When the producer enqueued it (the producer's clock).
    pub created_at: DateTime<Utc>,
}

impl WalMessage {
    /// The prefix of `tables`' messages.
    pub fn prefix(tables: &Tables) -> String {
        format!("pgoutbox:{}", tables.outbox_name())
    }

    /// The message for a validated `event` enqueued at `created_at`.
    pub(crate) fn new(
        event: &NewEvent,
        headers: Headers,
        created_at: DateTime<Utc>,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            v: FORMAT_VERSION,
            id: event.id,
            aggregate_type: event.aggregate_type.clone(),
            aggregate_id: event.aggregate_id.clone(),
            event_type: event.event_type.clone(),
            payload: RawValue::from_string(event.payload.clone())?,
            headers,
            destination: event.destination.clone(),
            created_at,
        })
    }

    /// Read a message's content; an error says what is wrong with it.
    pub fn decode(content: &[u8]) -> Result<Self, String> {
        let message: Self = serde_json::from_slice(content).map_err(|e| e.to_string())?;
        if message.v != FORMAT_VERSION {
            return Err(format!(
                "format version {} (this build reads {FORMAT_VERSION})",
                message.v
            ));
        }
        Ok(message)
    }

    /// The event as a relay hands it to a publisher; `seq` orders events of one
    /// stream (the commit order).
    pub fn into_event(self, seq: i64) -> Event {
        let mut event = Event::new(
            self.id,
            self.aggregate_type,
            self.aggregate_id,
            self.event_type,
            self.payload,
            self.created_at,
        );
        event.seq = seq;
        event.headers = self.headers;
        event.destination = self.destination;
        event
    }
}
