//! The replication slot and publication a WAL relay reads from, and the check
//! that a slot can carry this database's WAL outbox.
//!
//! `pgoutput` streams only for a publication, so each WAL outbox has one with no
//! table in it: its messages are all it carries. Creating both is idempotent.
//!
//! A slot belongs to the server, not to a database, but decodes only the WAL of
//! the database it was created in: a message written in any other database is
//! never read by it, and a slot created later starts at the server's current
//! position. So an event written while its database has no slot of its own is
//! lost, although its transaction committed. Hence:
//! - default slot names include the database ([`default_name`]), so outboxes of
//!   the same schema and table in two databases of one server get two slots;
//! - [`create`] refuses a slot of that name that exists and cannot carry this
//!   database's events (another database's, another plugin's, a temporary or an
//!   invalidated one), and changes nothing then;
//! - producers check the slot when built and in every write, in the statement
//!   that writes: a write that nothing would read fails, so its transaction
//!   cannot commit.

use sha2::{Digest, Sha256};
use sqlx::{Executor, PgConnection, PgExecutor, PgPool, Row};

use crate::error::{Error, Result};
use crate::ident::{Ident, MAX_IDENT_LEN};
use crate::sql::literal;
use crate::tables::Tables;

/// What every default slot name starts with.
const NAME_PREFIX: &str = "pgoutbox_";
/// Hex digits of the hash that ends a default slot name (48 bits).
const NAME_HASH_LEN: usize = 12;

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

/// The slot name of the outbox of `tables` in `database` unless one is
/// configured: `pgoutbox_<database>_<schema>_<table>_<hash>`, where the readable
/// part is lower-cased, has every character but `a-z`, `0-9` and `_` replaced by
/// `_`, and is cut to fit PostgreSQL's 63 bytes, and `<hash>` is the first 12 hex
/// digits of the SHA-256 of `<schema>.<table>@<database>` (exact names). The hash
/// keeps names apart that the readable part would mix up (`shop` + `eu_orders`
/// and `shop_eu` + `orders`, long names cut alike); in SQL it is
/// `left(encode(sha256(convert_to('<schema>.<table>@' || current_database(), 'UTF8')), 'hex'), 12)`.
pub fn default_name(database: &str, tables: &Tables) -> Result<Ident> {
    hashed_name(
        "slot",
        &format!("{database}_{}_{}", tables.schema(), tables.events()),
        &format!("{}@{database}", tables.outbox_name()),
    )
}

/// The publication of the outbox of `tables` unless one is configured:
/// `pgoutbox_<schema>_<table>` (a publication belongs to one database, so the
/// name needs no database), or when that is longer than 63 bytes its first part
/// and the first 12 hex digits of the SHA-256 of `<schema>.<table>`.
pub fn default_publication(tables: &Tables) -> Result<Ident> {
    let plain = format!("{NAME_PREFIX}{}_{}", tables.schema(), tables.events());
    if plain.len() <= MAX_IDENT_LEN {
        return Ident::new("publication", &plain);
    }
    hashed_name(
        "publication",
        &format!("{}_{}", tables.schema(), tables.events()),
        &tables.outbox_name(),
    )
}

/// `pgoutbox_<readable>_<hash>`: `readable` lower-cased, every character but
/// `a-z`, `0-9` and `_` replaced by `_`, cut to fit 63 bytes; `<hash>` the first
/// 12 hex digits of the SHA-256 of `exact`.
fn hashed_name(what: &'static str, readable: &str, exact: &str) -> Result<Ident> {
    let digest = Sha256::digest(exact.as_bytes());
    let hash: String = digest
        .iter()
        .take(NAME_HASH_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut readable: String = readable
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '_') => c,
            _ => '_',
        })
        .collect();
    // ASCII only by now: any length is a character boundary.
    readable.truncate(MAX_IDENT_LEN - NAME_PREFIX.len() - 1 - NAME_HASH_LEN);
    Ident::new(what, &format!("{NAME_PREFIX}{readable}_{hash}"))
}

/// The slot name earlier versions used by default, `pgoutbox_<schema>_<table>`
/// (the same in every database of a server); `None` when too long to be a name.
pub fn former_default_name(tables: &Tables) -> Option<Ident> {
    Ident::new(
        "slot",
        &format!("{NAME_PREFIX}{}_{}", tables.schema(), tables.events()),
    )
    .ok()
}

/// The slot the WAL outbox of `tables` uses in the database `conn` is connected
/// to: `configured` when given; else [`default_name`] for this database, unless
/// no slot of that name exists and one of the [`former_default_name`] can carry
/// this database's outbox: a deployment made before names included the database
/// keeps its slot (and with it every event the slot has not delivered yet).
pub async fn resolve(
    conn: &mut PgConnection,
    tables: &Tables,
    configured: Option<&Ident>,
) -> Result<Ident> {
    if let Some(slot) = configured {
        return Ok(slot.clone());
    }
    // Simple queries (no arguments), like `problem`'s.
    let database: String = conn
        .fetch_one("SELECT current_database()::text")
        .await?
        .try_get(0)?;
    let default = default_name(&database, tables)?;
    let Some(former) = former_default_name(tables) else {
        return Ok(default);
    };
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = {}), {}",
        literal(default.as_str()),
        problem_sql(&literal(former.as_str()))
    );
    let row = conn.fetch_one(sql.as_str()).await?;
    let (default_exists, former_problem): (bool, Option<String>) =
        (row.try_get(0)?, row.try_get(1)?);
    Ok(if !default_exists && former_problem.is_none() {
        former
    } else {
        default
    })
}

/// SQL text: why the slot named by the SQL text expression `slot` (a parameter
/// such as `$3`, or a quoted literal) cannot carry the WAL outbox of the current
/// database, or NULL when it can, from one look at `pg_replication_slots`. It
/// can when it is a logical slot of this database, with the plugin `pgoutput`,
/// not temporary, created completely (its consistent point reached: a slot still
/// being created does not decode the transactions that commit meanwhile), and not
/// invalidated. The first reason that applies is given, with what to do.
pub(crate) fn problem_sql(slot: &str) -> String {
    format!(
        "(SELECT CASE \
           WHEN s.slot_name IS NULL THEN format('no replication slot %s exists on this server: \
             events written now would never be published; create it first (outbox migrate \
             with [wal] enabled, or wal::slot::create)', {slot}) \
           WHEN s.slot_type <> 'logical' THEN format('replication slot %s is a physical slot: \
             name another slot for the WAL outbox', s.slot_name) \
           WHEN s.database <> current_database() THEN format('replication slot %s belongs to \
             database %s, not to %s: a slot decodes the WAL of its own database only, so events \
             written here would never be published; give this database''s outbox a slot of \
             its own (the default name includes the database; [wal] slot names one)', \
             s.slot_name, s.database, current_database()) \
           WHEN s.plugin <> 'pgoutput' THEN format('replication slot %s uses the output plugin \
             %s; the WAL outbox reads pgoutput: drop it or name another slot', \
             s.slot_name, s.plugin) \
           WHEN s.temporary THEN format('replication slot %s is temporary: it ends with the \
             session that made it; drop it or name another slot', s.slot_name) \
           WHEN s.wal_status = 'lost' THEN format('replication slot %s was invalidated (it fell \
             behind max_slot_wal_keep_size): events it had not delivered are lost; drop it \
             and create it again', s.slot_name) \
           WHEN s.confirmed_flush_lsn IS NULL THEN format('replication slot %s is still being \
             created (it waits for the transactions running when it started to end); try \
             again when it is', s.slot_name) \
         END \
         FROM (VALUES (1)) AS one (x) \
         LEFT JOIN pg_catalog.pg_replication_slots AS s ON s.slot_name = {slot})"
    )
}

/// What starts the text of a write refused by [`guard_sql`].
const REFUSED: &str = "pgoutbox: WAL outbox write refused: ";

/// SQL text: a boolean expression that is true when the slot named by the SQL text
/// expression `slot` can carry the WAL outbox of the current database
/// ([`problem_sql`]), and otherwise fails the statement (and so its
/// transaction) with the reason, SQLSTATE 22P02: `invalid input syntax for type
/// boolean: "pgoutbox: WAL outbox write refused: <reason>"`. Plain SQL has no
/// RAISE: the refusal is a cast that fails. The reason comes from the slot
/// lookup, so the planner cannot fold the cast into an error of every statement;
/// and the lookup is used once, so two looks cannot disagree (a second look that
/// found the slot usable would have made the expression NULL instead of failing).
/// It is never false or NULL. Evaluated in the statement that writes the events,
/// it costs one look at the server's slots; an SQL function writing events can
/// `PERFORM` it first.
pub(crate) fn guard_sql(slot: &str) -> String {
    format!(
        "coalesce('{REFUSED}' || {}, 'true')::boolean",
        problem_sql(slot)
    )
}

/// The refusal of [`guard_sql`] in `error` as [`Error::WalSlot`] for `slot`; any
/// other error as it is.
pub(crate) fn refusal(error: sqlx::Error, slot: &Ident) -> Error {
    let reason = match &error {
        sqlx::Error::Database(e) if e.code().as_deref() == Some("22P02") => {
            e.message().split_once(REFUSED).map(|(_, rest)| {
                // The cast quotes the refused text: drop the closing quote.
                rest.strip_suffix('"').unwrap_or(rest).to_string()
            })
        }
        _ => None,
    };
    match reason {
        Some(reason) => Error::WalSlot {
            slot: slot.to_string(),
            reason,
        },
        None => error.into(),
    }
}

/// Why `slot` cannot carry the WAL outbox of the database `conn` is connected to,
/// with what to do; `None` when it can: when it is a logical slot of this
/// database, with the plugin `pgoutput`, not temporary, not invalidated, and
/// created completely. A simple query (the name as a literal): it also answers
/// through a transaction pooler, where a prepared statement's round trips may
/// meet different server connections.
pub async fn problem(conn: &mut PgConnection, slot: &Ident) -> Result<Option<String>> {
    let sql = format!("SELECT {}", problem_sql(&literal(slot.as_str())));
    // No arguments: sent as a simple query.
    Ok(conn.fetch_one(sql.as_str()).await?.try_get(0)?)
}

/// `Ok` when `slot` can carry the WAL outbox of the database `conn` is connected
/// to, else [`Error::WalSlot`] with the reason.
pub async fn verify(conn: &mut PgConnection, slot: &Ident) -> Result<()> {
    match problem(conn, slot).await? {
        None => Ok(()),
        Some(reason) => Err(Error::WalSlot {
            slot: slot.to_string(),
            reason,
        }),
    }
}

/// Make the SQL emit function of `tables` (`<events>_emit`, migration 8, for
/// producers that write WAL events from SQL) check `slot` on every call, as
/// `WalOutbox` checks its writes: a write is refused with the reason (SQLSTATE
/// 55000, the message starting `pgoutbox: WAL outbox write refused:`) while the
/// slot cannot carry this database's events ([`problem`]). Until this runs, the
/// emit function refuses every write: nothing set up a slot for it. Idempotent;
/// `outbox migrate` with `[wal]` enabled runs it after creating the slot.
pub async fn guard_emit_function(pool: &PgPool, tables: &Tables, slot: &Ident) -> Result<()> {
    let sql = format!(
        "CREATE OR REPLACE FUNCTION {}() RETURNS void LANGUAGE plpgsql STABLE AS $$ \
         DECLARE problem text; \
         BEGIN \
             problem := {}; \
             IF problem IS NOT NULL THEN \
                 RAISE EXCEPTION '{REFUSED}%', problem \
                     USING ERRCODE = 'object_not_in_prerequisite_state'; \
             END IF; \
         END $$",
        tables.emit_check_function(),
        problem_sql(&literal(slot.as_str()))
    );
    sqlx::raw_sql(&sql).execute(pool).await?;
    Ok(())
}

/// Create the publication and the logical slot (plugin `pgoutput`) when missing.
/// Returns whether the slot was created now. A slot of that name that exists and
/// cannot carry this database's outbox ([`problem`]: another database's, another
/// plugin's, temporary, invalidated) is refused with [`Error::WalSlot`] before
/// anything is created.
pub async fn create(pool: &PgPool, slot: &Ident, publication: &Ident) -> Result<bool> {
    check_wal_level(pool).await?;
    let existed = exists(pool, slot).await?;
    if existed {
        verify(&mut *pool.acquire().await?, slot).await?;
    }
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
    if existed {
        return Ok(false);
    }
    match sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(slot.as_str())
        .execute(pool)
        .await
    {
        Ok(_) => Ok(true),
        // Created by a concurrent call meanwhile: it must be usable here too.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => {
            verify(&mut *pool.acquire().await?, slot)
                .await
                .map(|()| false)
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether a slot of that name exists on the server, in any database.
pub async fn exists<'e>(db: impl PgExecutor<'e>, slot: &Ident) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(slot.as_str())
    .fetch_one(db)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(schema: &str, events: &str) -> Tables {
        Tables::in_schema(schema)
            .and_then(|t| t.with_events_table(events))
            .unwrap()
    }

    #[test]
    fn default_names_include_the_database_and_fit_in_63_bytes() {
        let t = tables("public", "outbox_events");
        let name = default_name("test", &t).unwrap();
        assert!(
            name.as_str()
                .starts_with("pgoutbox_test_public_outbox_events_"),
            "{name}"
        );
        assert_eq!(
            name.as_str().len(),
            "pgoutbox_test_public_outbox_events_".len() + 12
        );
        // Deterministic, and another database gets another name.
        assert_eq!(default_name("test", &t).unwrap(), name);
        assert_ne!(default_name("test2", &t).unwrap(), name);
        // Names that read alike once joined or cut stay apart.
        let shop = default_name("shop", &tables("eu_orders", "outbox_events")).unwrap();
        let shop_eu = default_name("shop_eu", &tables("orders", "outbox_events")).unwrap();
        assert_ne!(shop, shop_eu);
        let long = "a".repeat(60);
        let one = default_name(&format!("{long}1"), &t).unwrap();
        let two = default_name(&format!("{long}2"), &t).unwrap();
        assert_ne!(one, two);
        assert_eq!(one.as_str().len(), MAX_IDENT_LEN);
        // Any database name becomes a valid slot name.
        let odd = default_name("Shop-EU ünïcode", &t).unwrap();
        assert!(
            odd.as_str().starts_with("pgoutbox_shop_eu__n_code_public_"),
            "{odd}"
        );
    }

    #[test]
    fn the_plain_name_is_the_default_publication_and_the_former_default_slot() {
        let t = tables("public", "outbox_events");
        for name in [default_publication(&t).ok(), former_default_name(&t)] {
            assert_eq!(name.unwrap().as_str(), "pgoutbox_public_outbox_events");
        }
        // Publications longer than 63 bytes are cut and hashed.
        let long = default_publication(&tables(&"s".repeat(44), "outbox_events")).unwrap();
        let longer = default_publication(&tables(&"s".repeat(45), "outbox_events")).unwrap();
        assert_eq!(long.as_str().len(), MAX_IDENT_LEN);
        assert_ne!(long, longer);
        // A former slot name of 9 + 40 + 14 bytes fits; one more does not.
        assert!(former_default_name(&tables(&"s".repeat(40), "outbox_events")).is_some());
        assert!(former_default_name(&tables(&"s".repeat(41), "outbox_events")).is_none());
    }
}
