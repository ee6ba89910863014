//! The producer side: an event as a transactional logical message.

use std::sync::Arc;

use pgoutbox_core::NewEvent;
use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use super::message::WalMessage;
use super::slot;
use crate::enqueue::{current_trace, headers_with_trace};
use crate::error::{Error, Result};
use crate::ident::Ident;
use crate::sql;
use crate::tables::Tables;

/// Writes events of one outbox to the WAL, in the caller's transaction.
///
/// Built with [`WalOutbox::connect`], which finds the outbox's replication slot
/// in the database and checks that it can carry this database's events: a slot
/// decodes only its own database's WAL, so an event written where no slot reads
/// it is lost although its transaction committed. Every write checks the slot
/// again in its own statement (one look at `pg_replication_slots`): a write that
/// nothing would read fails with [`Error::WalSlot`], and since its statement
/// failed, its transaction cannot commit. What no check can see: the slot dropped
/// between a write and its commit (`docs/design.md`, *Two modes*).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use pgoutbox_core::NewEvent;
/// use pgoutbox_postgres::{wal::WalOutbox, Tables};
///
/// // Once, at start: fails when this database has no usable slot for the outbox.
/// let outbox = WalOutbox::connect(&mut *pool.acquire().await?, &Tables::default()).await?;
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
    slot: Ident,
    /// The write statement, checking the slot named by its `$3`.
    emit: Arc<str>,
    /// The slot check of [`WalOutbox::commit`], the slot as a literal (that
    /// simple query takes no parameters).
    commit_guard: Arc<str>,
}

impl WalOutbox {
    /// The WAL outbox of `tables` (its messages' prefix is
    /// `pgoutbox:<schema>.<events_table>`; the tables hold its parked events) in
    /// the database `conn` is connected to (pass `&mut *pool.acquire().await?` of
    /// a pool), writing for the slot the relay reads by default
    /// ([`slot::resolve`]: the outbox's default name in this database, or the
    /// former default name of a slot made by an earlier version). Fails with
    /// [`Error::WalSlot`] when that slot is missing or cannot carry this
    /// database's events, saying why.
    pub async fn connect(conn: &mut PgConnection, tables: &Tables) -> Result<Self> {
        Self::connect_with(conn, tables, None).await
    }

    /// [`WalOutbox::connect`] for the slot named `slot` (the relay's
    /// `[wal] slot`).
    pub async fn connect_to_slot(
        conn: &mut PgConnection,
        tables: &Tables,
        slot: &Ident,
    ) -> Result<Self> {
        Self::connect_with(conn, tables, Some(slot)).await
    }

    async fn connect_with(
        conn: &mut PgConnection,
        tables: &Tables,
        configured: Option<&Ident>,
    ) -> Result<Self> {
        let slot = slot::resolve(conn, tables, configured).await?;
        slot::verify(conn, &slot).await?;
        Ok(Self {
            prefix: WalMessage::prefix(tables),
            emit: sql::wal_emit(&slot::guard_sql("$3")).into(),
            commit_guard: slot::guard_sql(&sql::literal(slot.as_str())).into(),
            slot,
        })
    }

    /// The prefix of this outbox's messages.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The slot every write checks.
    pub fn slot(&self) -> &Ident {
        &self.slot
    }

    /// Check the slot now, on `conn`, as every write does: `Ok`, or
    /// [`Error::WalSlot`] saying what is wrong. For a health check; the writes do
    /// not depend on it.
    pub async fn verify(&self, conn: &mut PgConnection) -> Result<()> {
        slot::verify(conn, &self.slot).await
    }

    /// Write one event on `conn` (pass `&mut *tx` or `&mut tx` of your transaction;
    /// outside a transaction it commits at once). Validated first, like the table
    /// outbox's `enqueue`: an invalid event is refused and nothing is written. An
    /// event with `not_before` is refused too: delaying needs the table outbox.
    /// When the slot cannot carry the event ([`Error::WalSlot`]), the statement
    /// fails: your transaction is aborted and cannot commit.
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
        let contents = self.messages(events)?;
        sqlx::query(&self.emit)
            .bind(&self.prefix)
            .bind(&contents)
            .bind(self.slot.as_str())
            .execute(conn)
            .await
            .map_err(|e| slot::refusal(e, &self.slot))?;
        Ok(events.iter().map(|e| e.id).collect())
    }

    /// Write `events` and commit `tx`, in one round trip to the server: the
    /// cheapest way to publish from a transaction (the business statements, then
    /// this call). Same validation as [`WalOutbox::enqueue_many`]: one invalid event
    /// refuses the whole call, nothing is written and `tx` is rolled back.
    ///
    /// `tx` must be the outermost transaction (not a savepoint): this commits it.
    /// An error from the commit itself (e.g. a deferred constraint) is returned as
    /// from [`Transaction::commit`]; the events are then not written either. The
    /// slot is checked first, in the same round trip: refused
    /// ([`Error::WalSlot`]), nothing commits and `tx` is rolled back.
    ///
    /// Afterwards the connection holds an empty transaction (no snapshot, no
    /// transaction id) until its next statement ends it: at once for a pooled
    /// connection, which sqlx pings when it returns to the pool. A bare
    /// `PgConnection` left unused longer than the server's
    /// `idle_in_transaction_session_timeout` is closed by the server: use it
    /// again or close it.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use pgoutbox_core::NewEvent;
    /// use pgoutbox_postgres::{wal::WalOutbox, Tables};
    ///
    /// let outbox = WalOutbox::connect(&mut *pool.acquire().await?, &Tables::default()).await?;
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (42)").execute(&mut *tx).await?;
    /// let created = NewEvent::new("order", "42", "order.created", &serde_json::json!({"total": 10}));
    /// outbox.commit(tx, &[created]).await?; // the order and its event, or neither
    /// # Ok(()) }
    /// ```
    pub async fn commit(
        &self,
        mut tx: Transaction<'_, Postgres>,
        events: &[NewEvent],
    ) -> Result<Vec<Uuid>> {
        use sqlx::TransactionManager as _;
        let depth = <Postgres as sqlx::Database>::TransactionManager::get_transaction_depth(&tx);
        if depth != 1 {
            return Err(Error::Wal(
                "WalOutbox::commit needs the outermost transaction, not a savepoint: \
                 call enqueue_many in the savepoint, or commit on the outer transaction"
                    .into(),
            ));
        }
        let contents = self.messages(events)?;
        let sql = sql::wal_emit_and_commit(&self.commit_guard, &self.prefix, &contents);
        sqlx::raw_sql(&sql)
            .execute(&mut *tx)
            .await
            .map_err(|e| slot::refusal(e, &self.slot))?;
        // Its queued ROLLBACK ends the empty transaction the statement opened.
        drop(tx);
        Ok(events.iter().map(|e| e.id).collect())
    }

    /// Each event validated and encoded as its message's content.
    fn messages(&self, events: &[NewEvent]) -> Result<Vec<String>> {
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
        Ok(contents)
    }
}
