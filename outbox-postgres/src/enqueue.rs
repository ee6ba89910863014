//! Writing events in the caller's transaction.

use std::sync::{Arc, OnceLock};

use chrono::{DateTime, Utc};
use pgoutbox_core::NewEvent;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::Result;
use crate::sql::{EnqueueSql, Sql};
use crate::tables::Tables;

/// Writes events into one outbox table, inside the caller's transaction.
///
/// Cheap to clone; build it once (it renders its two statements) and share it.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use pgoutbox_core::NewEvent;
/// use pgoutbox_postgres::Outbox;
///
/// let outbox = Outbox::default();
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id, total) VALUES ($1, $2)")
///     .bind(42_i64).bind(100_i64).execute(&mut *tx).await?;
/// outbox.enqueue(&mut tx, &NewEvent::new("order", "42", "order.created",
///     &serde_json::json!({"total": 100}))).await?;
/// tx.commit().await?; // the order and its event commit (or roll back) together
/// # Ok(()) }
/// ```
///
/// With the feature `wal`, [`Outbox::with_wal`] switches the same writer to the
/// WAL outbox (events as transactional logical messages, no table row): one
/// setting, the calls unchanged; the relay then reads a replication slot, which
/// the WAL outbox checks when connected and at every write (`docs/design.md`,
/// *Two modes*).
#[derive(Debug, Clone)]
pub struct Outbox {
    sql: Arc<EnqueueSql>,
    /// The crate's other statements for these tables, for what is built from this
    /// outbox (store, dead letters, cleanup, inbox): rendered on first use, shared
    /// by every clone, never by a producer.
    statements: Arc<OnceLock<Arc<Sql>>>,
    tables: Tables,
    /// Whether statements are prepared under a name and kept (sqlx's default), or
    /// sent unnamed (see [`Outbox::with_unnamed_statements`]).
    persistent: bool,
    /// Set: events go to the WAL instead of the table.
    #[cfg(feature = "wal")]
    wal: Option<crate::wal::WalOutbox>,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new(Tables::default())
    }
}

impl Outbox {
    /// An outbox writing to `tables`.
    pub fn new(tables: Tables) -> Self {
        Self {
            sql: Arc::new(EnqueueSql::new(&tables)),
            statements: Arc::default(),
            tables,
            persistent: true,
            #[cfg(feature = "wal")]
            wal: None,
        }
    }

    /// Write events to the WAL through `wal` instead of the outbox table (the
    /// default): the same calls, each event a transactional logical message. `wal`
    /// is this outbox's ([`crate::wal::WalOutbox::connect`] with the same
    /// tables, which checks the database's slot), else
    /// [`crate::Error::InvalidConfig`]. In WAL mode an event with `not_before` is
    /// refused: a WAL message is published as soon as it commits.
    #[cfg(feature = "wal")]
    pub fn with_wal(mut self, wal: crate::wal::WalOutbox) -> Result<Self> {
        let expected = crate::wal::WalMessage::prefix(&self.tables);
        if wal.prefix() != expected {
            return Err(crate::Error::InvalidConfig(format!(
                "with_wal: the WAL outbox writes messages `{}`, this outbox's are `{expected}`: \
                 connect it with the same tables",
                wal.prefix()
            )));
        }
        self.wal = Some(wal);
        Ok(self)
    }

    /// Whether events go to the WAL ([`Outbox::with_wal`]).
    pub fn is_wal(&self) -> bool {
        #[cfg(feature = "wal")]
        {
            self.wal.is_some()
        }
        #[cfg(not(feature = "wal"))]
        {
            false
        }
    }

    /// Send statements unnamed, for connections without a statement cache: those of
    /// [`crate::pooler_options`], through PgBouncer in transaction mode. There sqlx
    /// would name each statement anyway and leave it on the server connection, where
    /// another client's statement of the same name then fails. Defaults to `false`.
    /// Writers taken from a store ([`crate::PgStore::outbox`]) follow its pool.
    #[must_use]
    pub fn with_unnamed_statements(mut self, unnamed: bool) -> Self {
        self.persistent = !unnamed;
        self
    }

    /// The names in use.
    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// The statements of what is built from this outbox (rendered once, on first use).
    pub(crate) fn sql(&self) -> &Arc<Sql> {
        self.statements
            .get_or_init(|| Arc::new(Sql::new(&self.tables)))
    }

    /// `persistent` of every statement of this outbox (`false`: unnamed).
    pub(crate) fn persistent(&self) -> bool {
        self.persistent
    }

    /// Write one event on `conn` (pass `&mut *tx` or `&mut tx` of your transaction).
    ///
    /// The event is validated first; an invalid one is refused with
    /// [`crate::Error::InvalidEvent`] and nothing is written.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &NewEvent) -> Result<Uuid> {
        #[cfg(feature = "wal")]
        if let Some(wal) = &self.wal {
            return wal.enqueue(conn, event).await;
        }
        event.validate()?;
        let headers = headers_json(event, &current_trace());
        sqlx::query(&self.sql.one)
            .bind(event.id)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(headers)
            .bind(&event.destination)
            .bind(event.not_before)
            .persistent(self.persistent)
            .execute(conn)
            .await?;
        Ok(event.id)
    }

    /// Write many events with one statement, in the given order (which is also
    /// their per-aggregate publish order). All are validated first: one invalid
    /// event refuses the whole call and nothing is written.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<Uuid>> {
        #[cfg(feature = "wal")]
        if let Some(wal) = &self.wal {
            return wal.enqueue_many(conn, events).await;
        }
        for event in events {
            event.validate()?;
        }
        let trace = current_trace();
        let headers: Vec<String> = events.iter().map(|e| headers_json(e, &trace)).collect();
        let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
        let column = |f: fn(&NewEvent) -> &str| events.iter().map(f).collect::<Vec<&str>>();
        let destinations: Vec<Option<&str>> =
            events.iter().map(|e| e.destination.as_deref()).collect();
        let not_before: Vec<Option<DateTime<Utc>>> = events.iter().map(|e| e.not_before).collect();
        sqlx::query(&self.sql.many)
            .bind(&ids)
            .bind(column(|e| &e.aggregate_type))
            .bind(column(|e| &e.aggregate_id))
            .bind(column(|e| &e.event_type))
            .bind(column(|e| &e.payload))
            .bind(headers)
            .bind(destinations)
            .bind(not_before)
            .persistent(self.persistent)
            .execute(conn)
            .await?;
        Ok(ids)
    }

    /// Write `events` and commit `tx`: [`Outbox::enqueue_many`] then the commit,
    /// or in WAL mode both in one round trip ([`crate::wal::WalOutbox::commit`]).
    /// An invalid event refuses the call: nothing is written and `tx` is rolled
    /// back.
    pub async fn commit(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        events: &[NewEvent],
    ) -> Result<Vec<Uuid>> {
        #[cfg(feature = "wal")]
        if let Some(wal) = &self.wal {
            return wal.commit(tx, events).await;
        }
        let ids = self.enqueue_many(&mut tx, events).await?;
        tx.commit().await?;
        Ok(ids)
    }
}

/// Write one event into the default outbox (`public.outbox_events`) on `conn`.
///
/// Shorthand for `Outbox::default().enqueue(conn, event)`; build an [`Outbox`] once
/// to avoid rendering the SQL on every call or to use other table names.
pub async fn enqueue(conn: &mut PgConnection, event: &NewEvent) -> Result<Uuid> {
    static DEFAULT: std::sync::OnceLock<Outbox> = std::sync::OnceLock::new();
    DEFAULT
        .get_or_init(Outbox::default)
        .enqueue(conn, event)
        .await
}

/// The current span's trace context headers (feature `opentelemetry`), added to
/// events that carry no `traceparent` of their own; none without the feature.
pub(crate) fn current_trace() -> pgoutbox_core::Headers {
    #[cfg(feature = "opentelemetry")]
    return pgoutbox_core::trace_context::current_trace_headers();
    #[cfg(not(feature = "opentelemetry"))]
    pgoutbox_core::Headers::new()
}

/// Headers as JSON text, with `trace` added unless the event has a `traceparent`.
/// A map of strings always serialises; the fallback keeps this free of panics all
/// the same.
fn headers_json(event: &NewEvent, trace: &pgoutbox_core::Headers) -> String {
    serde_json::to_string(&headers_with_trace(event, trace)).unwrap_or_else(|_| "{}".to_string())
}

/// The event's headers, with `trace` added unless the event has a `traceparent`.
pub(crate) fn headers_with_trace(
    event: &NewEvent,
    trace: &pgoutbox_core::Headers,
) -> pgoutbox_core::Headers {
    let mut headers = event.headers.clone();
    if !trace.is_empty() && !event.headers.contains_key(pgoutbox_core::TRACEPARENT) {
        headers.extend(trace.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    headers
}
