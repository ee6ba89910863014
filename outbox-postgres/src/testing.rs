//! A throw-away outbox in its own schema on a real PostgreSQL, for tests.

use std::time::Duration;

use pgoutbox_core::{RelayConfig, RetryPolicy};
use sqlx::PgPool;

use crate::enqueue::Outbox;
use crate::error::Result;
use crate::pooler::caches_statements;
use crate::store::PgStore;
use crate::tables::Tables;

/// The database tests use: `DATABASE_URL`, or the local test database.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A pool of up to `max_connections` on the test database ([`database_url`]).
pub async fn pool(max_connections: u32) -> Result<PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(&database_url())
        .await?)
}

/// A relay configuration for tests against a real broker: batches of 50, a 20 ms
/// poll, a 30 s publish timeout, and retries 50-300 ms apart up to 1,000 attempts,
/// so that a test never dead-letters an event by exhausting its attempts.
pub fn broker_relay_config() -> RelayConfig {
    RelayConfig::default()
        .batch_size(50)
        .poll_interval(Duration::from_millis(20))
        .publish_timeout(Duration::from_secs(30))
        .retry(retries(1000, 50..=300))
}

/// A test's retry schedule: up to `max_attempts` attempts, the first retry
/// `delays_ms.start()` milliseconds after a failure, backing off to at most
/// `delays_ms.end()` milliseconds.
pub fn retries(max_attempts: u32, delays_ms: std::ops::RangeInclusive<u64>) -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(max_attempts)
        .base_delay(Duration::from_millis(*delays_ms.start()))
        .max_delay(Duration::from_millis(*delays_ms.end()))
}

/// An outbox in a fresh schema `outbox_test_<random>`, migrated; [`TestOutbox::drop_schema`]
/// removes it. Tests running in parallel each get their own.
#[derive(Debug, Clone)]
pub struct TestOutbox {
    /// A pool on the test database.
    pub pool: PgPool,
    /// The names, in the fresh schema.
    pub tables: Tables,
    /// A writer for the outbox.
    pub outbox: Outbox,
}

impl TestOutbox {
    /// Create and migrate a fresh outbox schema.
    pub async fn new() -> Result<Self> {
        Self::with_pool(pool(16).await?).await
    }

    /// Create and migrate a fresh outbox schema through `pool`, which may reach the
    /// test database another way (e.g. through a connection pooler).
    pub async fn with_pool(pool: PgPool) -> Result<Self> {
        let schema = format!("outbox_test_{}", uuid::Uuid::new_v4().simple());
        let tables = Tables::in_schema(&schema)?;
        crate::migrate(&pool, &tables).await?;
        Ok(Self {
            // Like the store's: unnamed statements on a pool without a statement cache.
            outbox: Outbox::new(tables.clone()).with_unnamed_statements(!caches_statements(&pool)),
            pool,
            tables,
        })
    }

    /// An outbox in a fresh schema with the migrations up to `version` applied and
    /// no later ones: a database migrated by an earlier release, to test upgrades
    /// ([`crate::migrate`] then applies the rest).
    pub async fn migrated_to(version: i32) -> Result<Self> {
        let pool = pool(16).await?;
        let schema = format!("outbox_test_{}", uuid::Uuid::new_v4().simple());
        let tables = Tables::in_schema(&schema)?;
        let script = crate::migration_script(&tables, 0);
        let end = script
            .find(&format!("\n-- migration {}:", version + 1))
            .unwrap_or(script.len());
        let mut tx = pool.begin().await?;
        sqlx::raw_sql(&script[..end]).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(Self {
            outbox: Outbox::new(tables.clone()).with_unnamed_statements(!caches_statements(&pool)),
            pool,
            tables,
        })
    }

    /// A relay store on this outbox with the default configuration.
    pub fn store(&self) -> PgStore {
        PgStore::new(self.pool.clone(), self.tables.clone())
    }

    /// Enqueue `events` in one committed transaction; returns their ids.
    pub async fn enqueue_committed(
        &self,
        events: &[pgoutbox_core::NewEvent],
    ) -> Result<Vec<uuid::Uuid>> {
        let mut tx = self.pool.begin().await?;
        let mut ids = Vec::with_capacity(events.len());
        for event in events {
            ids.push(self.outbox.enqueue(&mut tx, event).await?);
        }
        tx.commit().await?;
        Ok(ids)
    }

    /// Enqueue `events` with one [`Outbox::enqueue_many`] in one committed
    /// transaction; returns their ids.
    pub async fn enqueue_many_committed(
        &self,
        events: &[pgoutbox_core::NewEvent],
    ) -> Result<Vec<uuid::Uuid>> {
        self.write(Writer::Table, events, true).await
    }

    /// Enqueue `events` with one `enqueue_many` of `writer` in one transaction, then
    /// commit it, or roll it back when `commit` is false; returns their ids.
    pub async fn write(
        &self,
        writer: Writer,
        events: &[pgoutbox_core::NewEvent],
        commit: bool,
    ) -> Result<Vec<uuid::Uuid>> {
        let mut tx = self.pool.begin().await?;
        let ids = match writer {
            Writer::Table => self.outbox.enqueue_many(&mut tx, events).await?,
            #[cfg(feature = "wal")]
            Writer::Wal => self.wal().await?.enqueue_many(&mut tx, events).await?,
        };
        if commit {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        Ok(ids)
    }

    /// The WAL outbox of these tables, for the slot the relay reads by default
    /// ([`crate::wal::slot::resolve`]; [`TestSlot::create`] makes it): fails when
    /// the database has no usable slot for it.
    #[cfg(feature = "wal")]
    pub async fn wal(&self) -> Result<crate::wal::WalOutbox> {
        crate::wal::WalOutbox::connect(&mut *self.pool.acquire().await?, &self.tables).await
    }

    /// The WAL outbox of these tables for the slot named `slot`
    /// ([`crate::wal::WalOutbox::connect_to_slot`]).
    #[cfg(feature = "wal")]
    pub async fn wal_to_slot(&self, slot: &crate::Ident) -> Result<crate::wal::WalOutbox> {
        let mut conn = self.pool.acquire().await?;
        crate::wal::WalOutbox::connect_to_slot(&mut conn, &self.tables, slot).await
    }

    /// Drop the schema and everything in it.
    pub async fn drop_schema(&self) -> Result<()> {
        // Simple protocol: also right on a pool through a pooler (see `pooler.rs`).
        sqlx::raw_sql(&format!(
            "DROP SCHEMA {} CASCADE",
            self.tables.schema().quoted()
        ))
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// The seed's outbox as the readers of the Go + PostgreSQL article this project
/// follows create it (table, claim index, dead-letter view), in a fresh schema
/// `outbox_test_<random>`, for adoption tests; `{schema}` is where it goes.
pub const SEED_SCHEMA: &str = r#"
CREATE SCHEMA {schema};
CREATE TABLE {schema}.outbox_events (
    id             UUID         PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type VARCHAR(100) NOT NULL,
    aggregate_id   VARCHAR(100) NOT NULL,
    event_type     VARCHAR(100) NOT NULL,
    payload        JSONB        NOT NULL,
    attempts       INT          NOT NULL DEFAULT 0,
    created_at     TIMESTAMPTZ  NOT NULL DEFAULT NOW(),
    processed_at   TIMESTAMPTZ
);
CREATE INDEX idx_outbox_unprocessed ON {schema}.outbox_events (created_at) WHERE processed_at IS NULL;
CREATE VIEW {schema}.outbox_dead_letters AS SELECT * FROM {schema}.outbox_events
    WHERE attempts >= 5 AND processed_at IS NULL ORDER BY created_at;
"#;

/// The seed's producer statement (`InsertOutboxEvent`) against the seed's table in
/// `schema`: `$1` aggregate type, `$2` aggregate id, `$3` event type, `$4` payload.
pub fn seed_insert(schema: &crate::Ident) -> String {
    format!(
        "INSERT INTO {}.outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, $2, $3, $4)",
        schema.quoted()
    )
}

/// Create the seed's outbox ([`SEED_SCHEMA`]) in a fresh schema; its names.
pub async fn create_seed_outbox(pool: &PgPool) -> Result<Tables> {
    let schema = format!("outbox_test_{}", uuid::Uuid::new_v4().simple());
    let tables = Tables::in_schema(&schema)?;
    sqlx::raw_sql(&SEED_SCHEMA.replace("{schema}", &tables.schema().quoted()))
        .execute(pool)
        .await?;
    Ok(tables)
}

/// How [`TestOutbox::write`] writes events: into the outbox table ([`Outbox`]), or
/// to the WAL (`WalOutbox`, feature `wal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// Into the outbox table.
    Table,
    /// To the WAL, as transactional logical messages, for the outbox's default
    /// slot ([`TestOutbox::wal`]).
    #[cfg(feature = "wal")]
    Wal,
}

impl Drop for TestOutbox {
    /// A test that fails (panics) before [`TestOutbox::drop_schema`] would leave its
    /// schema behind in the test database: drop it then, on a connection of its own
    /// (the pool may be unusable by now). Nothing happens when no panic is unwinding.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let statement = format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            self.tables.schema().quoted()
        );
        block_on_detached(|| async move {
            use sqlx::Connection;
            let mut connection = sqlx::PgConnection::connect(&database_url()).await.ok()?;
            sqlx::raw_sql(&statement)
                .execute(&mut connection)
                .await
                .ok()
        });
    }
}

/// Run the future `work` makes to completion on a runtime of its own, on a thread
/// of its own, and wait for it; `None` when no runtime could be built or the work
/// panicked. For cleanup in `Drop`, which may run inside another runtime's worker
/// (which must not block on a future itself).
pub fn block_on_detached<W, F, T>(work: W) -> Option<T>
where
    W: FnOnce() -> F + Send + 'static,
    F: std::future::Future<Output = Option<T>>,
    T: Send + 'static,
{
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        runtime.block_on(work())
    })
    .join()
    .ok()
    .flatten()
}

#[cfg(feature = "wal")]
pub use slot_guard::{drop_slot_when_released, TestDatabase, TestSlot};

#[cfg(feature = "wal")]
mod slot_guard {
    use std::time::{Duration, Instant};

    use uuid::Uuid;

    use super::{block_on_detached, database_url, TestOutbox};
    use crate::ident::Ident;
    use crate::wal::{slot, WalOutbox, WalSource, WalStream};

    /// The outbox's slot (its default name in the test database, so that
    /// [`TestOutbox::wal`] finds it) and a publication of its own, dropped at the
    /// end of the test (also when it fails: an abandoned slot would keep WAL on the
    /// server for ever).
    #[derive(Debug)]
    pub struct TestSlot {
        /// The slot, `pgoutbox_<database>_<schema>_outbox_events_<hash>`.
        pub slot: Ident,
        /// Its publication, `outbox_test_wal_<random>`.
        pub publication: Ident,
    }

    impl TestSlot {
        /// Create the slot and publication (panics when the server cannot: `wal_level`
        /// must be `logical`).
        pub async fn create(outbox: &TestOutbox) -> Self {
            let id = &Uuid::new_v4().simple().to_string()[..12];
            let mut conn = outbox.pool.acquire().await.expect("a connection");
            let this = Self {
                slot: slot::resolve(&mut conn, &outbox.tables, None)
                    .await
                    .expect("the outbox's slot name"),
                publication: Ident::new("publication", &format!("outbox_test_wal_{id}"))
                    .expect("a valid name"),
            };
            drop(conn);
            let created = slot::create(&outbox.pool, &this.slot, &this.publication)
                .await
                .unwrap_or_else(|e| panic!("cannot create the test slot: {e}"));
            assert!(created, "the slot existed already");
            slot::guard_emit_function(&outbox.pool, &outbox.tables, &this.slot)
                .await
                .unwrap_or_else(|e| panic!("cannot guard the emit function: {e}"));
            this
        }

        /// Where to read it, acknowledging every 100 ms.
        pub fn source(&self) -> WalSource {
            let mut source = WalSource::new(
                database_url(),
                self.slot.as_str(),
                self.publication.as_str(),
            );
            source.status_interval = Duration::from_millis(100);
            source
        }

        /// A reader of the slot. The server releases a slot shortly after its previous
        /// reader disconnected: until then it refuses a new one ("is active").
        pub async fn stream(&self, outbox: &WalOutbox) -> WalStream {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match WalStream::connect(&self.source(), outbox.prefix()).await {
                    Ok(stream) => return stream,
                    Err(e) if e.to_string().contains("is active") && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("cannot read slot {}: {e}", self.slot),
                }
            }
        }
    }

    impl Drop for TestSlot {
        fn drop(&mut self) {
            drop_slot_when_released(self.slot.clone(), self.publication.clone());
        }
    }

    /// A database of its own on the test server (`outbox_test_db_<random>`), for
    /// tests of outboxes in two databases of one server. Dropped at the end of the
    /// test, also when it fails, with every replication slot made in it (a
    /// leftover slot keeps WAL on the server for ever).
    #[derive(Debug)]
    pub struct TestDatabase {
        /// Its name.
        pub name: String,
        /// A URL of it: [`database_url`] with this database.
        pub url: String,
        /// A pool on it.
        pub pool: sqlx::PgPool,
    }

    impl TestDatabase {
        /// Create the database (panics when the test server cannot).
        pub async fn create() -> Self {
            let name = format!(
                "outbox_test_db_{}",
                &Uuid::new_v4().simple().to_string()[..12]
            );
            let admin = sqlx::PgPool::connect(&database_url())
                .await
                .expect("the test database");
            sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
                .execute(&admin)
                .await
                .unwrap_or_else(|e| panic!("cannot create database {name}: {e}"));
            admin.close().await;
            let mut url = url::Url::parse(&database_url()).expect("a URL");
            url.set_path(&name);
            let url = url.to_string();
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(8)
                .connect(&url)
                .await
                .unwrap_or_else(|e| panic!("cannot connect to {name}: {e}"));
            Self { name, url, pool }
        }
    }

    impl Drop for TestDatabase {
        fn drop(&mut self) {
            let name = self.name.clone();
            block_on_detached(|| async move {
                let admin = sqlx::PgPool::connect(&database_url()).await.ok()?;
                // A slot is released shortly after its reader disconnected.
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let dropped = sqlx::query(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                         WHERE database = $1",
                    )
                    .bind(&name)
                    .execute(&admin)
                    .await;
                    if dropped.is_ok() || Instant::now() > deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&admin)
                    .await
                    .ok()
            });
        }
    }

    /// Drop a test's slot and publication from a `Drop` (its own connection and
    /// runtime), also when the test failed: an abandoned slot keeps WAL on the
    /// server for ever. The server releases a slot shortly after its reader
    /// disconnected: retried while it is still active, for up to 30 s.
    pub fn drop_slot_when_released(slot: Ident, publication: Ident) {
        block_on_detached(|| async move {
            let pool = sqlx::PgPool::connect(&database_url()).await.ok()?;
            let deadline = Instant::now() + Duration::from_secs(30);
            while slot::drop(&pool, &slot, &publication).await.is_err() {
                if Instant::now() > deadline {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(())
        });
    }
}
