//! Connecting to PostgreSQL with errors an operator can act on.

use pgoutbox_postgres::Tables;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::config::DatabaseSettings;
use crate::failure::Failure;

/// Whether the connections will claim events (and so get the claim timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Relay,
    Admin,
}

/// Connect: one connection is made at once so a wrong URL, an unreachable server or
/// a refused login is reported now, with the driver's reason (a pool alone would only
/// report a timeout), then the pool opens further connections as needed.
pub(crate) async fn connect(db: &DatabaseSettings, role: Role) -> Result<PgPool, Failure> {
    let mut options: PgConnectOptions = db
        .url
        .parse()
        .map_err(|e| Failure::config(format!("database.url: {e}")))?;
    let target = format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    );
    // Named in pg_stat_activity, so an operator can tell the relay's sessions apart
    // (and terminate them); `?application_name=` in the URL names them otherwise.
    if let Some(path) = &db.password_file {
        options = options.password(&read_password(path)?);
    }
    if options.get_application_name().is_none() {
        options = options.application_name("outbox");
    }
    if let (Role::Relay, Some(timeout)) = (role, db.claim_timeout) {
        // A relay cut off mid-batch must not keep its rows locked for longer.
        options = pgoutbox_postgres::relay_connect_options(options, timeout);
    }
    options = options.statement_cache_capacity(db.statement_cache);
    if db.pgbouncer {
        // No prepared statement cache (the store then sends its statements unnamed:
        // named ones do not survive transaction pooling) and no startup parameter
        // PgBouncer refuses.
        options = pgoutbox_postgres::pooler_options(options);
    }
    let probe = tokio::time::timeout(db.connect_timeout, options.connect())
        .await
        .map_err(|_| {
            Failure::runtime(format!(
                "cannot connect to the database at {target}: no answer within {}",
                humantime::format_duration(db.connect_timeout)
            ))
        })?
        .map_err(|e| {
            Failure::runtime(format!("cannot connect to the database at {target}: {e}"))
        })?;
    // Closed, not dropped: a dropped connection's session may linger on the server
    // next to the pool's, beyond `database.max_connections`.
    let _ = probe.close().await;
    let max = match role {
        Role::Relay => db.max_connections,
        Role::Admin => 2,
    };
    // The pool the library's own `relay_pool` builds, which the benchmarks
    // measure: no ping before each checkout.
    Ok(pgoutbox_postgres::relay_pool_options(max, db.connect_timeout).connect_lazy_with(options))
}

/// Fail with a hint when the outbox table does not exist (migrations not applied).
pub(crate) async fn ensure_migrated(pool: &PgPool, tables: &Tables) -> Result<(), Failure> {
    let name = format!("{}.{}", tables.schema().quoted(), tables.events().quoted());
    let failed =
        |e: sqlx::Error| Failure::runtime(format!("checking the outbox table {name}: {e}"));
    // Unnamed and in a transaction: right through PgBouncer too (a statement's round
    // trips stay on one server connection, none is left there), and this runs once.
    let mut tx = pool.begin().await.map_err(failed)?;
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(&name)
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    if exists.is_none() {
        return Err(Failure::runtime(format!(
            "the outbox table {name} does not exist: run `outbox migrate` with the same configuration first"
        )));
    }
    let missing = pgoutbox_postgres::unapplied_migrations(pool, tables)
        .await
        .map_err(|e| Failure::runtime(format!("checking the migrations of {name}: {e}")))?;
    if !missing.is_empty() {
        let list: Vec<String> = missing
            .iter()
            .map(|(version, name)| format!("{version} ({name})"))
            .collect();
        return Err(Failure::runtime(format!(
            "the outbox {name} lacks migration(s) {}: run `outbox migrate` with the same configuration (this version of the relay needs them)",
            list.join(", ")
        )));
    }
    Ok(())
}

/// The password in `path` (`database.password_file`).
pub(crate) fn read_password(path: &std::path::Path) -> Result<String, Failure> {
    pgoutbox_core::read_secret_file(path)
        .map_err(|e| Failure::config(format!("database.password_file {e}")))
}
