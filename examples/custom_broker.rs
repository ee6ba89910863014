//! The `outbox` binary with a broker of your own: the whole command line (`relay`,
//! `migrate`, `dead-letters`, `stats`, `cleanup`), configuration, metrics, health
//! endpoints and shutdown of `outbox`, publishing with a [`Publisher`] this file
//! defines. The "broker" here is an append-only file of JSON lines (one per event,
//! synced to disk before the relay marks the batch published); replace it with the
//! client of whatever your events must reach.
//!
//! ```text
//! cargo run -p outbox-examples --features custom-broker --bin custom_broker -- \
//!     --config outbox.toml relay
//! ```
//!
//! with, in `outbox.toml` (or `OUTBOX_BROKER=jsonl-file`):
//!
//! ```toml
//! [broker]
//! kind = "jsonl-file"
//!
//! [broker.jsonl-file]
//! path = "/var/lib/orders/events.jsonl"
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use pgoutbox::{Event, Outcome, PublishError, Publisher};
use pgoutbox_relay::{toml, App, BoxError};
use serde::Deserialize;

fn main() -> ExitCode {
    App::new().broker("jsonl-file", build).main()
}

/// The `[broker.jsonl-file]` section.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Section {
    /// The file events are appended to (created when missing).
    path: PathBuf,
}

/// The broker factory: reads the section, checks that the file can be written.
async fn build(section: toml::Table) -> Result<JsonLinesFile, BoxError> {
    let section: Section = section
        .try_into()
        .map_err(|e| format!("[broker.jsonl-file]: {e}"))?;
    let publisher = JsonLinesFile {
        path: Arc::from(section.path),
    };
    // Fail at start on a path that cannot be written (a missing directory, rights).
    publisher.check().await?;
    Ok(publisher)
}

/// Appends each event to a file as one JSON line; the batch is acknowledged once the
/// file is synced. Delivery is at least once: after a crash between the sync and the
/// relay recording the batch, the same event ids are appended again, and readers
/// skip ids they have seen (as any consumer of the outbox does).
struct JsonLinesFile {
    path: Arc<Path>,
}

impl JsonLinesFile {
    fn append(path: &Path, lines: &[u8]) -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        file.write_all(lines)?;
        file.sync_data()
    }
}

impl Publisher for JsonLinesFile {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut lines = Vec::new();
        for event in events {
            let line = serde_json::json!({
                "id": event.id,
                "aggregate_type": event.aggregate_type,
                "aggregate_id": event.aggregate_id,
                "event_type": event.event_type,
                "created_at": event.created_at,
                "headers": event.headers,
                "payload": event.payload,
            });
            lines.extend_from_slice(line.to_string().as_bytes());
            lines.push(b'\n');
        }
        let path = Arc::clone(&self.path);
        // File I/O blocks: keep it off the async workers.
        let written = tokio::task::spawn_blocking(move || Self::append(&path, &lines)).await;
        let outcome = match written {
            Ok(Ok(())) => Outcome::Published,
            // The file as a whole is unusable (disk full, rights): an outage, not a
            // failure of these events; the relay pauses and probes `check`.
            Ok(Err(error)) => Outcome::unavailable(format!("{}: {error}", self.path.display())),
            Err(error) => Outcome::retryable(format!("writer task: {error}")),
        };
        vec![outcome; events.len()]
    }

    async fn check(&self) -> Result<(), PublishError> {
        let path = Arc::clone(&self.path);
        let opened = tokio::task::spawn_blocking(move || Self::append(&path, b"")).await;
        match opened {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(PublishError::unavailable(format!(
                "{}: {error}",
                self.path.display()
            ))),
            Err(error) => Err(PublishError::unavailable(format!("writer task: {error}"))),
        }
    }
}
