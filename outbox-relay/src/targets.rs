//! The outboxes a command acts on: the one of `[tables]`, or the `[[outbox]]`
//! entries and the `[tenants]` schemas there are now, each on the pool of its
//! database (one pool per database: the connection budget its outboxes share).

use pgoutbox_core::RelayConfig;
use pgoutbox_postgres::Tables;
use sqlx::PgPool;

use crate::config::{DatabaseSettings, Settings, TenantsSettings};
use crate::db::{self, Role};
use crate::failure::Failure;

/// One outbox a command acts on.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// Its name in metrics, logs and `--outbox`.
    pub(crate) name: String,
    pub(crate) pool: PgPool,
    pub(crate) tables: Tables,
    /// Its relay's configuration (its own limits).
    pub(crate) relay: RelayConfig,
}

/// One pool per database URL.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    by_url: Vec<(String, PgPool)>,
}

impl Pools {
    /// The pool of `url` (`None`: `[database]`'s), connected on first use.
    pub(crate) async fn of(
        &mut self,
        database: &DatabaseSettings,
        url: Option<&str>,
        role: Role,
    ) -> Result<PgPool, Failure> {
        let url = url.unwrap_or(&database.url);
        if let Some((_, pool)) = self.by_url.iter().find(|(u, _)| u == url) {
            return Ok(pool.clone());
        }
        let mut settings = database.clone();
        settings.url = url.to_string();
        let pool = db::connect(&settings, role).await?;
        self.by_url.push((url.to_string(), pool.clone()));
        Ok(pool)
    }

    /// Every pool opened, for a last look (readiness) and for closing.
    pub(crate) fn all(&self) -> Vec<PgPool> {
        self.by_url.iter().map(|(_, pool)| pool.clone()).collect()
    }

    pub(crate) async fn close(&self) {
        for (_, pool) in &self.by_url {
            pool.close().await;
        }
    }
}

/// The configured outboxes: `[tables]`'s one, or every `[[outbox]]` entry (not
/// the `[tenants]` found by name: [`tenants_now`]).
pub(crate) async fn configured(
    settings: &Settings,
    pools: &mut Pools,
    role: Role,
) -> Result<Vec<Target>, Failure> {
    let database = settings.database()?;
    if !settings.grouped() {
        return Ok(vec![Target {
            name: settings.tables.outbox_name(),
            pool: pools.of(database, None, role).await?,
            tables: settings.tables.clone(),
            relay: settings.relay.clone(),
        }]);
    }
    let mut targets = Vec::with_capacity(settings.outboxes.len());
    for outbox in &settings.outboxes {
        targets.push(Target {
            name: outbox.name.clone(),
            pool: pools
                .of(database, outbox.database_url.as_deref(), role)
                .await?,
            tables: outbox.tables.clone(),
            relay: outbox.relay.clone(),
        });
    }
    Ok(targets)
}

/// The `[tenants]` schemas in the database now, named `schema.table` as their
/// relays are.
pub(crate) async fn tenants_now(
    pool: &PgPool,
    tenants: &TenantsSettings,
) -> Result<Vec<Target>, Failure> {
    let schemas = pgoutbox_postgres::tenant_schemas(pool, &tenants.pattern, &tenants.events_table)
        .await
        .map_err(|e| {
            Failure::runtime(format!(
                "looking for the tenant schemas `{}`: {e}",
                tenants.pattern
            ))
        })?;
    schemas
        .into_iter()
        .map(|schema| {
            let tables = Tables::in_schema(&schema)
                .and_then(|t| t.with_events_table(&tenants.events_table))
                .map_err(|e| Failure::config(format!("tenant schema `{schema}`: {e}")))?;
            Ok(Target {
                name: tables.outbox_name(),
                pool: pool.clone(),
                tables,
                relay: tenants.relay.clone(),
            })
        })
        .collect()
}

/// Every outbox an admin command acts on (configured and tenants found now), or
/// only the one `selector` names (its name, `schema.table` or schema).
pub(crate) async fn resolve(
    settings: &Settings,
    pools: &mut Pools,
    selector: Option<&str>,
) -> Result<Vec<Target>, Failure> {
    let mut targets = configured(settings, pools, Role::Admin).await?;
    if let Some(tenants) = &settings.tenants {
        let pool = pools.of(settings.database()?, None, Role::Admin).await?;
        targets.extend(tenants_now(&pool, tenants).await?);
    }
    select(targets, selector)
}

/// Keep the target `selector` names, or all of them when it is `None`.
fn select(targets: Vec<Target>, selector: Option<&str>) -> Result<Vec<Target>, Failure> {
    let Some(wanted) = selector.map(str::trim) else {
        return Ok(targets);
    };
    let names: Vec<String> = targets.iter().map(|t| t.name.clone()).collect();
    let chosen: Vec<Target> = targets
        .into_iter()
        .filter(|t| {
            t.name == wanted
                || t.tables.outbox_name() == wanted
                || t.tables.schema().as_str() == wanted
        })
        .collect();
    match chosen.len() {
        0 => Err(Failure::config(format!(
            "--outbox {wanted}: no such outbox; there are: {}",
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        ))),
        1 => Ok(chosen),
        _ => Err(Failure::config(format!(
            "--outbox {wanted}: names several outboxes ({}): give the full name",
            chosen
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
