//! The consumer inbox: process each event id once, inside the consumer's transaction.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::enqueue::Outbox;
use crate::error::{Error, Result};
use crate::ident::Ident;
use crate::sql::Sql;

/// What [`Inbox::process`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// First delivery: the handler ran and its transaction committed.
    First(T),
    /// Already processed by this consumer: the handler did not run.
    Duplicate,
}

/// Failure of [`Inbox::process`]: nothing was committed, the event can be processed again.
#[derive(Debug, thiserror::Error)]
pub enum InboxError<E> {
    /// The handler failed; its writes and the inbox record were rolled back.
    #[error("event handler failed: {0}")]
    Handler(E),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] Error),
}

/// Records which events a consumer has processed, so duplicates are skipped.
///
/// Brokers deliver at least once and the relay may publish twice after a crash;
/// the inbox turns that into effectively-once processing for handlers whose effects
/// live in the same database.
#[derive(Debug, Clone)]
pub struct Inbox {
    sql: Arc<Sql>,
    persistent: bool,
    consumer: String,
}

impl Inbox {
    /// The inbox of `consumer` (e.g. `billing`): each consumer processes each event once.
    pub fn new(outbox: &Outbox, consumer: &str) -> Result<Self> {
        // Same rules as SQL names: predictable, printable, short.
        Ident::new("consumer", consumer)?;
        Ok(Self {
            sql: Arc::clone(outbox.sql()),
            persistent: outbox.persistent(),
            consumer: consumer.to_string(),
        })
    }

    /// Record `event_id` on `conn` (inside the consumer's transaction). Returns
    /// `true` the first time, `false` for a duplicate. A concurrent transaction
    /// recording the same id waits for this one, then sees a duplicate if this commits.
    pub async fn record(&self, conn: &mut PgConnection, event_id: Uuid) -> Result<bool> {
        let done = sqlx::query(&self.sql.inbox_record)
            .bind(&self.consumer)
            .bind(event_id)
            .persistent(self.persistent)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// In one transaction: record `event_id`, and run `handler` only if it is new.
    /// A handler error rolls everything back, so a later delivery runs it again.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, inbox: pgoutbox_postgres::Inbox, id: uuid::Uuid) {
    /// let outcome = inbox
    ///     .process(&pool, id, |conn| Box::pin(async move {
    ///         sqlx::query("UPDATE stock SET reserved = reserved + 1").execute(conn).await
    ///     }))
    ///     .await;
    /// # }
    /// ```
    pub async fn process<T, E, F>(
        &self,
        pool: &PgPool,
        event_id: Uuid,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        let mut tx = pool.begin().await.map_err(Error::from)?;
        if !self.record(&mut tx, event_id).await? {
            tx.rollback().await.map_err(Error::from)?;
            return Ok(Processed::Duplicate);
        }
        match handler(&mut tx).await {
            Ok(value) => {
                tx.commit().await.map_err(Error::from)?;
                Ok(Processed::First(value))
            }
            Err(error) => {
                tx.rollback().await.map_err(Error::from)?;
                Err(InboxError::Handler(error))
            }
        }
    }
}
