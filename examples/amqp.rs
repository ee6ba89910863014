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

use pgoutbox::amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, QueueBindOptions, QueueDeclareOptions,
};
use pgoutbox::amqp::lapin::types::FieldTable;
use pgoutbox::amqp::lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use pgoutbox::amqp::AmqpConfig;
use pgoutbox::postgres::{Inbox, Outbox, PgStore};
use pgoutbox::Relay;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use order_service::{ConsumeUntil, Error, OrderCreated, Pending};

const QUEUE: &str = "billing";

const ABOUT: &str = "Order service on RabbitMQ: orders and their events commit in one transaction, a relay publishes them to the exchange `outbox`, a consumer processes each once.";
const AFTER_HELP: &str = "Without arguments it runs until Ctrl-C. RabbitMQ: OUTBOX_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f) and the other OUTBOX_AMQP_* variables; the queue `billing`.";

#[tokio::main]
async fn main() {
    order_service::init_tracing("info,sqlx=warn,lapin=warn");
    order_service::exit_on_error("amqp", run().await);
}

async fn run() -> Result<(), Error> {
    let orders = order_service::orders_arg("amqp", ABOUT, AFTER_HELP, None);
    let db = order_service::connect("amqp").await?;

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

    let outbox = Outbox::new(db.tables.clone());
    let store = PgStore::new(db.pool.clone(), db.tables.clone());
    let relay = Relay::new(store, publisher).with_config(order_service::relay_config());
    let inbox = Inbox::new(&outbox, "billing")?;

    let stop = order_service::stop_on_ctrl_c("amqp");
    let pending = Pending::default();
    let processed = order_service::run_service(
        &stop,
        relay.run(stop.clone().cancelled_owned()),
        order_service::produce("amqp", &db, &outbox, orders, Some(&pending), &stop),
        consume(
            &channel,
            &db.pool,
            &inbox,
            orders.is_some(),
            &pending,
            &stop,
        ),
    )
    .await?;
    let _ = connection.close(0, "bye").await;
    eprintln!(
        "amqp: published {} events, processed {processed}, bye",
        relay.stats().snapshot().published
    );
    db.pool.close().await;
    Ok(())
}

/// Process events once each (the inbox skips duplicates). In demo mode, return when
/// every event of this run was consumed (at most 60 s); otherwise at Ctrl-C.
async fn consume(
    channel: &Channel,
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
            message = channel.basic_get(QUEUE, BasicGetOptions::default()) => message?,
        };
        // basic.get keeps the example short; a service would use basic_consume.
        let Some(message) = message else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let meta = match pgoutbox::amqp::metadata(&message) {
            Ok(meta) => meta,
            Err(error) => {
                eprintln!("amqp: skipping a message: {error}");
                message.ack(BasicAckOptions::default()).await?;
                continue;
            }
        };
        let order: OrderCreated = match meta.decode(&message.data) {
            Ok(order) => order,
            Err(error) => {
                eprintln!("amqp: skipping a message: {error}");
                message.ack(BasicAckOptions::default()).await?;
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
        message.ack(BasicAckOptions::default()).await?;
        pending.consumed(meta.event_id);
    }
}
