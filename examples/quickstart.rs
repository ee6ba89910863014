//! Quickstart: an order service using the outbox with PostgreSQL alone.
//!
//! Creates the schema `example_quickstart` with an `orders` table and the outbox,
//! then creates orders: each order row and its `order.created` event are written in
//! one transaction. A relay running in the same process publishes the events with
//! the stdout publisher (one JSON line per event). Ctrl-C stops it cleanly; `--orders N` creates N orders and
//! exits once all are published.
//!
//! ```text
//! cargo run -p outbox-examples --bin quickstart
//! ```

#[path = "shared/order_service.rs"]
mod order_service;

use std::time::Duration;

use pgoutbox::postgres::{Outbox, PgStore};
use pgoutbox::{Relay, StdoutPublisher, Store};
use tokio_util::sync::CancellationToken;

use order_service::{Database, Error, Example};

const EXAMPLE: Example = Example {
    name: "quickstart",
    about: "An order service using the outbox with PostgreSQL alone: each order and its event commit in one transaction; a relay prints the events (one JSON line each).",
    after_help: "Without arguments it creates an order every second until Ctrl-C.",
    default_orders: None,
    log_filter: "info,sqlx=warn",
};

#[tokio::main]
async fn main() {
    // 1. Schema: `order_service::main` connects, creates the outbox (idempotent) and
    //    the business table, then calls `run` with them.
    order_service::main(EXAMPLE, run).await;
}

async fn run(db: Database, orders: Option<u32>) -> Result<(), Error> {
    // 2. The relay, publishing to stdout, until Ctrl-C (or until the demo is done).
    let store = PgStore::new(db.pool.clone(), db.tables.clone());
    let relay =
        Relay::new(store.clone(), StdoutPublisher).with_config(order_service::relay_config());
    let stop = order_service::stop_on_ctrl_c("quickstart");
    let producer = async {
        let result = produce(&db, &store, orders, &stop).await;
        // The demo is done (or failed): stop the relay too.
        stop.cancel();
        result
    };
    let ((), produced) = tokio::join!(relay.run(stop.clone().cancelled_owned()), producer);
    produced?;
    let stats = relay.stats().snapshot();
    eprintln!("quickstart: published {} events, bye", stats.published);
    Ok(())
}

/// Create orders: each order row and its event commit in one transaction.
/// With a count, create that many and wait until they are all published; without,
/// one every second until `stop` is cancelled (Ctrl-C).
async fn produce(
    db: &Database,
    store: &PgStore,
    count: Option<u32>,
    stop: &CancellationToken,
) -> Result<(), Error> {
    let outbox = Outbox::new(db.tables.clone());
    order_service::produce("quickstart", db, &outbox, count, None, stop).await?;
    if stop.is_cancelled() {
        return Ok(());
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
