//! The producer side: an event as a transactional logical message.

use pgoutbox_core::NewEvent;
use sqlx::PgConnection;
use uuid::Uuid;

use super::message::WalMessage;
use crate::enqueue::{current_trace, headers_with_trace};
use crate::error::{Error, Result};
use crate::tables::Tables;

/// Writes events of one outbox to the WAL, in the caller's transaction.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use pgoutbox_core::NewEvent;
/// use pgoutbox_postgres::{wal::WalOutbox, Tables};
///
/// let outbox = WalOutbox::new(&Tables::default());
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES (42)").execute(&mut *tx).await?;
/// outbox
///     .enqueue(&mut tx, &NewEvent::new("order", "42", "order.created", &serde_json::json!({"total": 10})))
///     .await?;
/// tx.commit().await?; // the event exists only if the order does
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct WalOutbox {
    prefix: String,
}

impl WalOutbox {
    /// The WAL outbox named after `tables` (its messages' prefix is
    /// `pgoutbox:<schema>.<events_table>`); the tables hold its parked events.
    pub fn new(tables: &Tables) -> Self {
        Self {
            prefix: WalMessage::prefix(tables),
        }
    }

    /// The prefix of this outbox's messages.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Write one event on `conn` (pass `&mut *tx` or `&mut tx` of your transaction;
    /// outside a transaction it commits at once). Validated first, like the table
    /// outbox's `enqueue`: an invalid event is refused and nothing is written. An
    /// event with `not_before` is refused too: delaying needs the table outbox.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &NewEvent) -> Result<Uuid> {
        self.enqueue_many(conn, std::slice::from_ref(event))
            .await
            .map(|_| event.id)
    }

    /// Write many events with one statement, in the given order (their publish
    /// order within each aggregate). All are validated first: one invalid event
    /// refuses the whole call and nothing is written.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<Uuid>> {
        let trace = current_trace();
        let now = chrono::Utc::now();
        let mut contents = Vec::with_capacity(events.len());
        for event in events {
            event.validate()?;
            if event.not_before.is_some() {
                return Err(Error::Wal(format!(
                    "event {}: not_before needs the table outbox (a WAL message is published as soon as it commits)",
                    event.id
                )));
            }
            let message = WalMessage::new(event, headers_with_trace(event, &trace), now)
                .and_then(|m| serde_json::to_string(&m))
                .map_err(|e| Error::Wal(format!("event {}: {e}", event.id)))?;
            contents.push(message);
        }
        // One message per element, emitted as the scan of `unnest` yields them: in
        // array order.
        sqlx::query(
            "SELECT count(pg_logical_emit_message(true, $1, content)) \
             FROM unnest($2::text[]) AS m(content)",
        )
        .bind(&self.prefix)
        .bind(&contents)
        .execute(conn)
        .await?;
        Ok(events.iter().map(|e| e.id).collect())
    }
}
