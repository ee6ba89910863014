//! Order service on RabbitMQ: orders and their `order.created` events commit in one
//! PostgreSQL transaction; a relay publishes the events (publisher confirms, mandatory)
//! to the topic exchange `outbox`; a consumer in the same process reads the queue
//! `billing` (bound to `order.#`) and processes each event id once with the inbox.
//!
//! ```text
//! cargo run -p outbox-examples --features amqp --bin amqp               # until Ctrl-C
//! cargo run -p outbox-examples --features amqp --bin amqp -- --orders 5 # demo, then exit
//! ```
//!
//! `DATABASE_URL` defaults to `postgres://postgres@127.0.0.1:5432/test`; broker settings
//! come from `OUTBOX_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) and the
//! other `OUTBOX_AMQP_*` variables.

#[path = "shared/order_service.rs"]
mod order_service;

use std::time::Duration;

use pgoutbox::amqp::lapin::message::BasicGetMessage;
use pgoutbox::amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, QueueBindOptions, QueueDeclareOptions,
};
use pgoutbox::amqp::lapin::types::FieldTable;
use pgoutbox::amqp::lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use pgoutbox::amqp::{AmqpConfig, Metadata};

use order_service::{Database, Deliveries, Error, Example};

const QUEUE: &str = "billing";

const EXAMPLE: Example = Example {
    name: "amqp",
    about: "Order service on RabbitMQ: orders and their events commit in one transaction, a relay publishes them to the exchange `outbox`, a consumer processes each once.",
    after_help: "Without arguments it runs until Ctrl-C. RabbitMQ: OUTBOX_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f) and the other OUTBOX_AMQP_* variables; the queue `billing`.",
    default_orders: None,
    log_filter: "info,sqlx=warn,lapin=warn",
};

#[tokio::main]
async fn main() {
    order_service::main(EXAMPLE, run).await;
}

async fn run(db: Database, orders: Option<u32>) -> Result<(), Error> {
    // The publisher and its exchange, then the consumer's queue bound to it.
    let config = AmqpConfig::from_env()?;
    let amqp_url = config.url.clone();
    let publisher = config
        .connect()
        .await
        .map_err(|e| format!("{e} (is rabbitmq-server running?)"))?;
    publisher.declare_exchange(ExchangeKind::Topic).await?;
    let exchange = publisher.routing().exchange().to_string();
    let connection = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            QUEUE,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            QUEUE,
            &exchange,
            "order.#",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    eprintln!("amqp: publishing to exchange {exchange}, consuming queue {QUEUE}");

    order_service::serve("amqp", &db, publisher, "billing", orders, Queue(&channel)).await?;
    let _ = connection.close(0, "bye").await;
    Ok(())
}

/// The queue's messages, fetched one at a time with basic.get (it keeps the
/// example short; a service would use basic_consume) and acknowledged once processed.
struct Queue<'c>(&'c Channel);

impl Deliveries for Queue<'_> {
    type Message = BasicGetMessage;

    async fn next(&mut self) -> Result<Vec<BasicGetMessage>, Error> {
        match self.0.basic_get(QUEUE, BasicGetOptions::default()).await? {
            Some(message) => Ok(vec![message]),
            None => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(Vec::new())
            }
        }
    }

    fn metadata(&self, message: &BasicGetMessage) -> Result<Metadata, Error> {
        Ok(pgoutbox::amqp::metadata(message)?)
    }

    fn body<'m>(&self, message: &'m BasicGetMessage) -> &'m [u8] {
        &message.data
    }

    async fn settle(&mut self, message: BasicGetMessage) -> Result<(), Error> {
        Ok(message.ack(BasicAckOptions::default()).await?)
    }
}
