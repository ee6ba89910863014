//! The replication slot and publication a WAL relay reads from.
//!
//! `pgoutput` streams only for a publication, so each WAL outbox has one with no
//! table in it: its messages are all it carries. Creating both is idempotent.

use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::ident::Ident;

/// The server's `wal_level`; anything but `logical` is an error naming the fix.
pub async fn check_wal_level(pool: &PgPool) -> Result<()> {
    let level: String = sqlx::query_scalar("SHOW wal_level").fetch_one(pool).await?;
    if level == "logical" {
        return Ok(());
    }
    Err(Error::Wal(format!(
        "wal_level is `{level}`, the WAL outbox needs `logical`: set it \
         (ALTER SYSTEM SET wal_level = logical; on RDS rds.logical_replication = 1) \
         and restart PostgreSQL"
    )))
}

/// Create the publication and the logical slot (plugin `pgoutput`) when missing.
/// Returns whether the slot was created now.
pub async fn create(pool: &PgPool, slot: &Ident, publication: &Ident) -> Result<bool> {
    check_wal_level(pool).await?;
    let published: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication.as_str())
            .fetch_one(pool)
            .await?;
    if !published {
        // No table: the publication exists for `pgoutput`, which streams the
        // logical messages of every transaction whatever the publication holds.
        let sql = format!("CREATE PUBLICATION {}", publication.quoted());
        match sqlx::query(&sql).execute(pool).await {
            Ok(_) => {}
            // Created by a concurrent call meanwhile.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => {}
            Err(e) => return Err(e.into()),
        }
    }
    if exists(pool, slot).await? {
        return Ok(false);
    }
    match sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(slot.as_str())
        .execute(pool)
        .await
    {
        Ok(_) => Ok(true),
        // Created by a concurrent call meanwhile.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the slot exists.
pub async fn exists(pool: &PgPool, slot: &Ident) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(slot.as_str())
    .fetch_one(pool)
    .await?)
}

/// Drop the slot (the server then stops keeping WAL for it) and the publication;
/// missing ones are fine. An active slot (a relay reading it) is an error.
pub async fn drop(pool: &PgPool, slot: &Ident, publication: &Ident) -> Result<()> {
    if exists(pool, slot).await? {
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(slot.as_str())
            .execute(pool)
            .await?;
    }
    sqlx::query(&format!(
        "DROP PUBLICATION IF EXISTS {}",
        publication.quoted()
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// How far the slot's consumer is behind the server, in bytes of WAL: what a
/// stopped relay makes the server keep. `None` when the slot is missing.
pub async fn lag_bytes(pool: &PgPool, slot: &Ident) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot.as_str())
    .fetch_optional(pool)
    .await?
    .flatten())
}
