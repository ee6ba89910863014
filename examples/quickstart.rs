//! Quickstart: an order service using the outbox with PostgreSQL alone.
//!
//! Creates an `orders` table and the outbox, then creates orders: each order row
//! and its `order.created` event are written in one transaction. A relay running
//! in the same process publishes the events with the stdout publisher (one JSON
//! line per event). Ctrl-C stops it cleanly; `--orders N` creates N orders and
//! exits once all are published.
//!
//! ```text
//! cargo run -p outbox-examples --bin quickstart
//! ```

use std::time::Duration;

use outbox::postgres::{migrate, Outbox, PgStore, Tables};
use outbox::{NewEvent, Relay, RelayConfig, StdoutPublisher, Store};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(error) = run().await {
        eprintln!("quickstart: {error}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let orders: Option<u32> = match std::env::args().skip_while(|a| a != "--orders").nth(1) {
        Some(n) => Some(
            n.parse()
                .map_err(|_| format!("--orders expects a number, got {n:?}"))?,
        ),
        None => None,
    };
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_string());
    let pool = PgStore::connect(&url, 4, Duration::from_secs(60))
        .await
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;

    // 1. Schema: the outbox (idempotent) and the business table.
    let tables = Tables::default();
    migrate(&pool, &tables).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            customer text NOT NULL,
            total_cents bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await?;

    // 2. The relay, publishing to stdout, until Ctrl-C (or until the demo is done).
    let store = PgStore::new(pool.clone(), tables.clone());
    let relay = Relay::new(store.clone(), StdoutPublisher).with_config(RelayConfig {
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    });
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("quickstart: Ctrl-C, finishing the batch in flight");
            }
            stop.cancel();
        }
    });
    let producer = async {
        let result = produce(&pool, &Outbox::new(tables), &store, orders, &stop).await;
        // The demo is done (or failed): stop the relay too.
        stop.cancel();
        result
    };
    let ((), produced) = tokio::join!(relay.run(stop.clone().cancelled_owned()), producer);
    produced?;
    let stats = relay.stats().snapshot();
    eprintln!("quickstart: published {} events, bye", stats.published);
    pool.close().await;
    Ok(())
}

/// Create orders: each order row and its event commit in one transaction.
/// With a count, create that many and wait until they are all published; without,
/// one every second until `stop` is cancelled (Ctrl-C).
async fn produce(
    pool: &PgPool,
    outbox: &Outbox,
    store: &PgStore,
    count: Option<u32>,
    stop: &CancellationToken,
) -> Result<(), Box<dyn std::error::Error>> {
    let customers = ["ada", "grace", "linus", "barbara"];
    let mut n: u32 = 0;
    loop {
        if stop.is_cancelled() {
            return Ok(());
        }
        if count.is_some_and(|c| n >= c) {
            break;
        }
        let customer = customers[n as usize % customers.len()];
        let total_cents = 1_000 + i64::from(n) * 250;
        let mut tx = pool.begin().await?;
        let order_id: i64 = sqlx::query_scalar(
            "INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
        )
        .bind(customer)
        .bind(total_cents)
        .fetch_one(&mut *tx)
        .await?;
        let event = NewEvent::new(
            "order",
            order_id.to_string(),
            "order.created",
            &serde_json::json!({ "order_id": order_id, "customer": customer, "total_cents": total_cents }),
        );
        outbox.enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        eprintln!(
            "quickstart: created order {order_id} for {customer} (event {})",
            event.id
        );
        n += 1;
        if count.is_none() {
            tokio::select! {
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
    // Wait for the relay to publish everything before stopping it.
    for _ in 0..600 {
        if store.pending().await? == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("events were not published within 30 s".into())
}
