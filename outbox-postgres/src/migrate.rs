//! Applying the schema in `migrations/` to a database, idempotently.

use std::collections::HashSet;

use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::pooler::caches_statements;
use crate::sql::Sql;
use crate::tables::Tables;

/// A migration shipped with this crate.
struct Migration {
    version: i32,
    name: &'static str,
    template: &'static str,
}

/// Every migration, in order. The SQL lives in the workspace's `migrations/` folder; the
/// crate reaches it through its own `migrations` link, so that a packaged crate ships it.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        template: include_str!("../migrations/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "notify_function",
        template: include_str!("../migrations/0002_notify_function.sql"),
    },
    Migration {
        version: 3,
        name: "holds",
        template: include_str!("../migrations/0003_holds.sql"),
    },
    Migration {
        version: 4,
        name: "probe_function",
        template: include_str!("../migrations/0004_probe_function.sql"),
    },
];

/// Create the outbox objects named by `tables` (schema, events table, indexes,
/// dead-letter view, inbox table), applying only migrations not applied yet.
///
/// Safe to run concurrently from several processes: a transaction-scoped advisory
/// lock serialises them, and each migration commits with its version record.
pub async fn migrate(pool: &PgPool, tables: &Tables) -> Result<()> {
    let sql = Sql::new(tables);
    let persistent = caches_statements(pool);
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(&sql.migration_lock_key)
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
    sqlx::query(&sql.create_schema)
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
    sqlx::query(&sql.migrations_table)
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
    let applied: HashSet<i32> = sqlx::query_scalar(&sql.applied_versions)
        .persistent(persistent)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
    for migration in not_in(&applied) {
        let rendered = render(migration.template, &sql.template_names);
        let failed = |source| Error::Migration {
            version: migration.version,
            name: migration.name,
            source,
        };
        sqlx::raw_sql(&rendered)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::query(&sql.record_version)
            .bind(migration.version)
            .bind(migration.name)
            .persistent(persistent)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        tracing::info!(version = migration.version, name = migration.name, schema = %tables.schema(), "outbox migration applied");
    }
    tx.commit().await?;
    Ok(())
}

/// The migrations of this crate not applied yet to the outbox named by `tables`,
/// as `(version, name)`: all of them if it was never migrated. A relay started on
/// an outbox with some missing would fail on the first statement that needs them.
pub async fn unapplied_migrations(
    pool: &PgPool,
    tables: &Tables,
) -> Result<Vec<(i32, &'static str)>> {
    let sql = Sql::new(tables);
    let persistent = caches_statements(pool);
    // In a transaction, so that a pooler keeps one server connection for each
    // statement's round trips (see `pooler.rs`).
    let mut tx = pool.begin().await?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&sql.migrations_name)
        .persistent(persistent)
        .fetch_one(&mut *tx)
        .await?;
    let applied: HashSet<i32> = if exists {
        sqlx::query_scalar(&sql.applied_versions)
            .persistent(persistent)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect()
    } else {
        HashSet::new()
    };
    tx.commit().await?;
    Ok(not_in(&applied).map(|m| (m.version, m.name)).collect())
}

/// The migrations whose versions are not in `applied`, in order.
fn not_in(applied: &HashSet<i32>) -> impl Iterator<Item = &'static Migration> + '_ {
    MIGRATIONS.iter().filter(|m| !applied.contains(&m.version))
}

fn render(template: &str, names: &[(&'static str, String)]) -> String {
    names
        .iter()
        .fold(template.to_string(), |sql, (key, value)| {
            sql.replace(&format!("{{{{{key}}}}}"), value)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placeholder_is_replaced() {
        let sql = Sql::new(&Tables::default());
        for m in MIGRATIONS {
            let rendered = render(m.template, &sql.template_names);
            assert!(
                !rendered.contains("{{"),
                "unreplaced name in migration {}",
                m.version
            );
            assert!(rendered.contains("\"public\"."), "migration {}", m.version);
        }
    }
}
