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

use pgoutbox::nats::{EventConsumer, EventMessage, Metadata, NatsConfig};

use order_service::{Database, Deliveries, Error, Example};

const STREAM: &str = "OUTBOX_ORDERS";

const EXAMPLE: Example = Example {
    name: "nats",
    about: "Order service on NATS JetStream: orders and their events commit in one transaction, a relay publishes them to JetStream, a consumer processes each once.",
    after_help: "Without arguments it runs until Ctrl-C. NATS: OUTBOX_NATS_URL (default nats://127.0.0.1:4222) and the other OUTBOX_NATS_* variables; the stream OUTBOX_ORDERS.",
    default_orders: None,
    log_filter: "info,sqlx=warn,async_nats=warn",
};

#[tokio::main]
async fn main() {
    order_service::main(EXAMPLE, run).await;
}

async fn run(db: Database, orders: Option<u32>) -> Result<(), Error> {
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

    order_service::serve(
        "nats",
        &db,
        publisher,
        "billing",
        orders,
        JetStream(consumer),
    )
    .await?;
    Ok(())
}

/// The JetStream consumer's messages, acknowledged once processed.
struct JetStream(EventConsumer);

impl Deliveries for JetStream {
    type Message = EventMessage;

    async fn next(&mut self) -> Result<Vec<EventMessage>, Error> {
        // Wake up now and then to see whether the demo is complete.
        match tokio::time::timeout(Duration::from_millis(200), self.0.next()).await {
            Err(_) => Ok(Vec::new()),
            Ok(Some(Ok(message))) => Ok(vec![message]),
            Ok(Some(Err(error))) => {
                eprintln!("nats: skipping a message: {error}");
                Ok(Vec::new())
            }
            Ok(None) => Err("the JetStream consumer ended".into()),
        }
    }

    fn metadata(&self, message: &EventMessage) -> Result<Metadata, Error> {
        Ok(message.metadata.clone())
    }

    fn body<'m>(&self, message: &'m EventMessage) -> &'m [u8] {
        &message.message.payload
    }

    async fn settle(&mut self, message: EventMessage) -> Result<(), Error> {
        Ok(message.ack().await?)
    }
}
