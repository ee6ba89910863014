//! Publishers that need no broker: for running the outbox with PostgreSQL alone,
//! for in-process consumers, and for benchmarks.

use std::io::Write;

use serde::Serialize;
use tokio::sync::mpsc;

use crate::event::Event;
use crate::publisher::{Outcome, Publisher};

/// Writes each event as one JSON line to standard output.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdoutPublisher;

#[derive(Serialize)]
struct Line<'a> {
    id: &'a uuid::Uuid,
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_type: &'a str,
    created_at: &'a chrono::DateTime<chrono::Utc>,
    attempt: u32,
    headers: &'a crate::event::Headers,
    payload: &'a serde_json::value::RawValue,
}

impl Publisher for StdoutPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut out = std::io::stdout().lock();
        events
            .iter()
            .map(|e| {
                let line = Line {
                    id: &e.id,
                    aggregate_type: &e.aggregate_type,
                    aggregate_id: &e.aggregate_id,
                    event_type: &e.event_type,
                    created_at: &e.created_at,
                    attempt: e.attempts + 1,
                    headers: &e.headers,
                    payload: &e.payload,
                };
                let written = serde_json::to_writer(&mut out, &line)
                    .map_err(|e| e.to_string())
                    .and_then(|()| writeln!(out).map_err(|e| e.to_string()));
                match written {
                    Ok(()) => Outcome::Published,
                    Err(error) => Outcome::retryable(format!("stdout: {error}")),
                }
            })
            .collect()
    }
}

/// Sends each event to an in-process [`mpsc`] channel, waiting while it is full.
///
/// A closed receiver is a retryable failure: the events stay in the outbox.
#[derive(Debug, Clone)]
pub struct ChannelPublisher {
    sender: mpsc::Sender<Event>,
}

impl ChannelPublisher {
    /// A publisher and the receiver of its events, with room for `capacity` events.
    pub fn new(capacity: usize) -> (Self, mpsc::Receiver<Event>) {
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        (Self { sender }, receiver)
    }

    /// A publisher sending to an existing channel.
    pub fn from_sender(sender: mpsc::Sender<Event>) -> Self {
        Self { sender }
    }
}

impl Publisher for ChannelPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(events.len());
        for event in events {
            outcomes.push(match self.sender.send(event.clone()).await {
                Ok(()) => Outcome::Published,
                Err(_) => Outcome::retryable("in-process channel closed"),
            });
        }
        outcomes
    }

    async fn check(&self) -> Result<(), crate::PublishError> {
        if self.sender.is_closed() {
            return Err(crate::PublishError::retryable("in-process channel closed"));
        }
        Ok(())
    }
}

/// Accepts every event and does nothing: measures the relay and the store alone.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullPublisher;

impl Publisher for NullPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        vec![Outcome::Published; events.len()]
    }
}
