//! Many tenants, one relay process: each tenant has its own schema with its own
//! outbox, and one `TenantDiscovery` relays every schema named `example_tenant_*`,
//! finding new tenants while it runs. Events are printed by the stdout publisher
//! (one JSON line each).
//!
//! ```text
//! cargo run -p outbox-examples --bin tenants
//! ```
//!
//! It creates the tenants `a` and `b` with two events each, starts the relays,
//! then creates tenant `c` while they run; it exits once all six events are
//! published. `DATABASE_URL` defaults to `postgres://postgres@127.0.0.1:5432/test`.

#[path = "shared/order_service.rs"]
mod order_service;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutbox::postgres::{migrate, relay_pool, Outbox, PgStore, Tables, TenantDiscovery};
use pgoutbox::{DynPublisher, NewEvent, StdoutPublisher, Store};
use sqlx::PgPool;

use order_service::Error;

const PREFIX: &str = "example_tenant_";

/// Many tenants, one relay process: one schema and outbox per tenant, every
/// schema named example_tenant_* relayed by one TenantDiscovery, a tenant added
/// while it runs; events printed as JSON lines. Exits once all are published.
#[derive(clap::Parser)]
#[command(name = "tenants")]
struct Args {}

#[tokio::main]
async fn main() {
    order_service::init_tracing("info,sqlx=warn");
    order_service::exit_on_error("tenants", run().await);
}

async fn run() -> Result<(), Error> {
    let Args {} = clap::Parser::parse();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // One pool for every tenant of this database: it is their connection budget.
    let pool = relay_pool(&url, 4, Duration::from_secs(30))
        .await
        .map_err(|e| format!("{e} (is PostgreSQL running? DATABASE_URL)"))?;
    for tenant in ["a", "b", "c"] {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {PREFIX}{tenant} CASCADE"))
            .execute(&pool)
            .await?;
    }
    for tenant in ["a", "b"] {
        new_tenant(&pool, tenant).await?;
    }

    // Every schema named like `example_tenant_%` that holds an outbox, looked for
    // again every 500 ms (`\_`: a literal underscore in LIKE).
    let publisher: Arc<dyn DynPublisher> = Arc::new(StdoutPublisher);
    let discovery = TenantDiscovery::new(
        pool.clone(),
        format!("{}%", PREFIX.replace('_', "\\_")),
        publisher,
    )
    .interval(Duration::from_millis(500));
    let stop = order_service::stop_on_ctrl_c("tenants");
    let demo = async {
        wait_until_published(&pool, &["a", "b"]).await?;
        // A tenant arrives while the relays run: found at the next look.
        new_tenant(&pool, "c").await?;
        wait_until_published(&pool, &["a", "b", "c"]).await?;
        eprintln!("tenants: relayed {}", discovery.tenants().join(", "));
        Ok::<_, Error>(())
    };
    let (result, ()) = tokio::join!(
        async {
            let result = demo.await;
            stop.cancel();
            result
        },
        discovery.run(stop.clone().cancelled_owned())
    );
    result?;
    eprintln!("tenants: all events published, bye");
    pool.close().await;
    Ok(())
}

/// Create the tenant's schema with its outbox, and two events in it.
async fn new_tenant(pool: &PgPool, tenant: &str) -> Result<(), Error> {
    let tables = Tables::in_schema(&format!("{PREFIX}{tenant}"))?;
    migrate(pool, &tables).await?;
    let outbox = Outbox::new(tables);
    let events: Vec<NewEvent> = (1..=2)
        .map(|n| {
            let order = serde_json::json!({ "tenant": tenant, "order_id": n });
            NewEvent::new("order", n.to_string(), "order.created", &order)
        })
        .collect();
    let mut tx = pool.begin().await?;
    outbox.enqueue_many(&mut tx, &events).await?;
    tx.commit().await?;
    eprintln!("tenants: tenant {tenant} created with 2 events");
    Ok(())
}

/// Wait (at most 30 s) until these tenants' outboxes have nothing pending.
async fn wait_until_published(pool: &PgPool, tenants: &[&str]) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut pending = 0;
        for tenant in tenants {
            let tables = Tables::in_schema(&format!("{PREFIX}{tenant}"))?;
            pending += PgStore::new(pool.clone(), tables).pending().await?;
        }
        if pending == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{pending} events still pending after 30 s").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
