//! Consumer side: read the event id and metadata back from NATS messages.

use serde::de::DeserializeOwned;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, Message as JsMessage};
use chrono::DateTime;
use futures_util::StreamExt;
use pgoutbox_core::envelope::Metadata;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::headers;

/// The outbox metadata of a message published by [`crate::NatsPublisher`] (a
/// JetStream message derefs to it), the same [`Metadata`] type as every adapter's.
/// Errors name the missing or invalid header; an invalid creation time reads as
/// absent.
///
/// ```no_run
/// # fn demo(message: &pgoutbox_nats::async_nats::Message) -> Result<(), pgoutbox_nats::Error> {
/// let meta = pgoutbox_nats::metadata(message)?;
/// println!("{} {} of {}/{}", meta.event_id, meta.event_type, meta.aggregate_type, meta.aggregate_id);
/// # Ok(()) }
/// ```
pub fn metadata(message: &async_nats::Message) -> Result<Metadata> {
    let not_event = |reason: String| Error::NotAnEvent {
        subject: message.subject.to_string(),
        reason,
    };
    let Some(map) = &message.headers else {
        return Err(not_event("it has no headers".into()));
    };
    // The last value of each header, as name/value pairs for the shared parser.
    let mut pairs: Vec<(&str, &str)> = map
        .iter()
        .filter_map(|(name, values)| {
            let value = values.last()?;
            Some((AsRef::<str>::as_ref(name), AsRef::<str>::as_ref(value)))
        })
        .collect();
    // JetStream's dedup header carries the id too, when the outbox header is gone.
    if find(&pairs, headers::EVENT_ID).is_none() {
        if let Some(id) = find(&pairs, headers::MSG_ID) {
            pairs.push((headers::EVENT_ID, id));
        }
    }
    // The creation time is optional here: an invalid one reads as absent (`None`).
    let valid_time =
        find(&pairs, headers::CREATED_AT).is_some_and(|t| DateTime::parse_from_rfc3339(t).is_ok());
    if !valid_time {
        pairs.retain(|(k, _)| !k.eq_ignore_ascii_case(headers::CREATED_AT));
    }
    pairs.retain(|(k, _)| !k.eq_ignore_ascii_case(headers::MSG_ID));
    Metadata::from_message(&headers::BINDING, pairs, None, &message.payload)
        .map_err(|e| not_event(e.to_string()))
}

/// A JetStream message with its outbox metadata.
#[derive(Debug)]
pub struct EventMessage {
    /// The event's metadata.
    pub metadata: Metadata,
    /// The message: payload, and `ack()` once processed.
    pub message: JsMessage,
}

impl EventMessage {
    /// The event id.
    pub fn id(&self) -> Uuid {
        self.metadata.event_id
    }

    /// The event's JSON payload: the message body, or the `data` of a structured
    /// CloudEvent.
    pub fn payload(&self) -> std::result::Result<&[u8], pgoutbox_core::DecodeError> {
        self.metadata.payload(&self.message.payload)
    }

    /// The JSON payload read as `T`; an error names the event id and type.
    pub fn decode<T: DeserializeOwned>(
        &self,
    ) -> std::result::Result<T, pgoutbox_core::DecodeError> {
        self.metadata.decode(&self.message.payload)
    }

    /// Acknowledge the message so the server does not deliver it again.
    pub async fn ack(&self) -> Result<()> {
        self.message
            .ack()
            .await
            .map_err(|e| Error::jetstream("ack", e))
    }
}

/// A durable pull consumer on a stream whose messages come with their [`Metadata`].
///
/// Messages must be acknowledged ([`EventMessage::ack`]) after processing; with an
/// inbox ([`pgoutbox_postgres::Inbox`](https://docs.rs/pgoutbox-postgres)) a redelivered
/// message is recognised by its id.
pub struct EventConsumer {
    consumer: PullConsumer,
    messages: Option<pull::Stream>,
}

impl std::fmt::Debug for EventConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventConsumer").finish_non_exhaustive()
    }
}

impl EventConsumer {
    /// Create (or reuse) the durable consumer `durable` on `stream`, receiving the
    /// subjects matching `filter` (empty: all of the stream), explicit acks.
    pub async fn durable(
        jetstream: &jetstream::Context,
        stream: &str,
        durable: &str,
        filter: &str,
    ) -> Result<Self> {
        let operation = format!("create consumer {durable} on stream {stream}");
        let stream_handle = jetstream
            .get_stream(stream)
            .await
            .map_err(|e| Error::jetstream(&operation, e))?;
        let consumer: PullConsumer = stream_handle
            .get_or_create_consumer(
                durable,
                pull::Config {
                    durable_name: Some(durable.to_string()),
                    filter_subject: filter.to_string(),
                    ack_policy: AckPolicy::Explicit,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(|e| Error::jetstream(&operation, e))?;
        Ok(Self {
            consumer,
            messages: None,
        })
    }

    /// Up to `max` messages, waiting at most `wait` for them. A message that is not an
    /// outbox event is acknowledged (so it does not come back) and returned as an error.
    pub async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Result<EventMessage>>> {
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(max.max(1))
            .expires(wait)
            .messages()
            .await
            .map_err(|e| Error::jetstream("fetch", e))?;
        let mut out = Vec::new();
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| Error::jetstream("fetch", e))?;
            out.push(wrap(message).await);
        }
        Ok(out)
    }

    /// The next message, waiting as long as it takes (wrap in a timeout or `select!`
    /// to stop). `None` when the consumer is gone.
    pub async fn next(&mut self) -> Option<Result<EventMessage>> {
        if self.messages.is_none() {
            match self.consumer.messages().await {
                Ok(stream) => self.messages = Some(stream),
                Err(e) => return Some(Err(Error::jetstream("consume", e))),
            }
        }
        let message = self.messages.as_mut()?.next().await?;
        Some(match message {
            Ok(message) => wrap(message).await,
            Err(e) => Err(Error::jetstream("consume", e)),
        })
    }
}

async fn wrap(message: JsMessage) -> Result<EventMessage> {
    match metadata(&message) {
        Ok(metadata) => Ok(EventMessage { metadata, message }),
        Err(error) => {
            // Not ours: acknowledge so it does not come back forever.
            let _ = message.ack().await;
            Err(error)
        }
    }
}

/// The value of header `name` (compared ignoring ASCII case) among `pairs`.
fn find<'a>(pairs: &[(&str, &'a str)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|&(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message with the outbox headers, `created_at` as given.
    fn message(created_at: Option<&str>) -> async_nats::Message {
        let mut map = async_nats::HeaderMap::new();
        map.insert(headers::EVENT_ID, Uuid::now_v7().to_string().as_str());
        map.insert(headers::EVENT_TYPE, "order.created");
        map.insert(headers::AGGREGATE_TYPE, "order");
        map.insert(headers::AGGREGATE_ID, "42");
        if let Some(t) = created_at {
            map.insert(headers::CREATED_AT, t);
        }
        async_nats::Message {
            subject: "outbox.order.created".into(),
            reply: None,
            payload: Default::default(),
            headers: Some(map),
            status: None,
            description: None,
            length: 0,
        }
    }

    #[test]
    fn creation_time_is_read_or_absent_never_made_up() {
        let dated = metadata(&message(Some("2026-12-04T10:00:00Z"))).unwrap();
        assert_eq!(
            dated.created_at.map(|t| t.to_rfc3339()),
            Some("2026-12-04T10:00:00+00:00".to_string())
        );
        for undated in [None, Some("yesterday")] {
            let meta = metadata(&message(undated)).unwrap();
            assert_eq!(meta.created_at, None, "created_at header {undated:?}");
            assert_eq!(meta.aggregate_id, "42");
        }
    }
}
