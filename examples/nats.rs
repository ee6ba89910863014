//! Order service on NATS JetStream: orders and their `order.created` events commit in
//! one PostgreSQL transaction; a relay publishes the events to JetStream; a consumer in
//! the same process reads them and processes each event id once with the inbox.
//!
//! ```text
//! cargo run -p outbox-examples --features nats --bin nats               # until Ctrl-C
//! cargo run -p outbox-examples --features nats --bin nats -- --orders 5 # demo, then exit
//! ```
//!
//! `DATABASE_URL` defaults to `postgres://postgres@127.0.0.1:5432/test`; NATS settings
//! come from `OUTBOX_NATS_URL` (default `nats://127.0.0.1:4222`) and the other
//! `OUTBOX_NATS_*` variables. The stream `OUTBOX_ORDERS` captures `<prefix>.>`.

#[path = "shared/order_service.rs"]
mod order_service;

use std::time::Duration;

use pgoutbox::nats::{EventConsumer, EventMessage, NatsConfig};
use pgoutbox::postgres::{Inbox, Outbox, PgStore};
use pgoutbox::Relay;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use order_service::{ConsumeUntil, Error, OrderCreated, Pending};

const STREAM: &str = "OUTBOX_ORDERS";

const ABOUT: &str = "Order service on NATS JetStream: orders and their events commit in one transaction, a relay publishes them to JetStream, a consumer processes each once.";
const AFTER_HELP: &str = "Without arguments it runs until Ctrl-C. NATS: OUTBOX_NATS_URL (default nats://127.0.0.1:4222) and the other OUTBOX_NATS_* variables; the stream OUTBOX_ORDERS.";

#[tokio::main]
async fn main() {
    order_service::init_tracing("info,sqlx=warn,async_nats=warn");
    order_service::exit_on_error("nats", run().await);
}

async fn run() -> Result<(), Error> {
    let orders = order_service::orders_arg("nats", ABOUT, AFTER_HELP, None);
    let db = order_service::connect("nats").await?;

    // The publisher and its stream (idempotent), then a durable consumer on it.
    let config = NatsConfig::from_env()?;
    let nats_url = pgoutbox::redact_url(&config.url);
    let publisher = config
        .connect()
        .await
        .map_err(|e| format!("{e} (is nats-server -js running?)"))?;
    publisher
        .ensure_stream(publisher.stream_config(STREAM))
        .await?;
    let consumer = EventConsumer::durable(publisher.jetstream(), STREAM, "billing", "").await?;
    eprintln!("nats: publishing to {nats_url}, stream {STREAM}");

    let outbox = Outbox::new(db.tables.clone());
    let store = PgStore::new(db.pool.clone(), db.tables.clone());
    let relay = Relay::new(store, publisher).with_config(order_service::relay_config());
    let inbox = Inbox::new(&outbox, "billing")?;

    let stop = order_service::stop_on_ctrl_c("nats");
    let pending = Pending::default();
    let processed = order_service::run_service(
        &stop,
        relay.run(stop.clone().cancelled_owned()),
        order_service::produce("nats", &db, &outbox, orders, Some(&pending), &stop),
        consume(
            consumer,
            &db.pool,
            &inbox,
            orders.is_some(),
            &pending,
            &stop,
        ),
    )
    .await?;
    eprintln!(
        "nats: published {} events, processed {processed}, bye",
        relay.stats().snapshot().published
    );
    db.pool.close().await;
    Ok(())
}

/// Process events once each (the inbox skips duplicates). In demo mode, return when
/// every event of this run was consumed (at most 60 s); otherwise at Ctrl-C.
async fn consume(
    mut consumer: EventConsumer,
    pool: &PgPool,
    inbox: &Inbox,
    demo: bool,
    pending: &Pending,
    stop: &CancellationToken,
) -> Result<u64, Error> {
    let until = ConsumeUntil::new(demo);
    let mut processed = 0;
    loop {
        if until.done(pending) {
            return Ok(processed);
        }
        let message = tokio::select! {
            () = stop.cancelled() => return Ok(processed),
            error = until.timeout() => return Err(error),
            // Wake up now and then to see whether the demo is complete.
            message = tokio::time::timeout(Duration::from_millis(200), consumer.next()) => match message {
                Ok(message) => message,
                Err(_) => continue,
            },
        };
        let message: EventMessage = match message {
            Some(Ok(message)) => message,
            Some(Err(error)) => {
                eprintln!("nats: skipping a message: {error}");
                continue;
            }
            None => return Err("the JetStream consumer ended".into()),
        };
        let meta = message.metadata.clone();
        let order: OrderCreated = match message.decode() {
            Ok(order) => order,
            Err(error) => {
                eprintln!("nats: skipping a message: {error}");
                message.ack().await?;
                continue;
            }
        };
        if order_service::process(inbox, pool, meta.event_id, || {
            format!("{} event {}: {order}", meta.event_type, meta.event_id)
        })
        .await?
        {
            processed += 1;
        }
        message.ack().await?;
        pending.consumed(meta.event_id);
    }
}
