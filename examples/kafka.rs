//! Order service on Kafka: orders and their `order.created` events commit in one
//! PostgreSQL transaction; a relay publishes the events to Kafka; a consumer in the
//! same process reads them and processes each event id once with the inbox.
//!
//! ```text
//! cargo run -p outbox-examples --features kafka --bin kafka                # 5 orders, then exit
//! cargo run -p outbox-examples --features kafka --bin kafka -- --orders 20 # 20 orders, then exit
//! cargo run -p outbox-examples --features kafka --bin kafka -- --forever   # one a second until Ctrl-C
//! ```
//!
//! `DATABASE_URL` defaults to `postgres://postgres@127.0.0.1:5432/test`. Kafka settings
//! come from `OUTBOX_KAFKA_BROKERS` and the other `OUTBOX_KAFKA_*` variables; without
//! `OUTBOX_KAFKA_BROKERS` the example starts librdkafka's in-process mock cluster.
//! Events go to the topic `outbox-orders`, created (3 partitions) when missing.

#[path = "shared/order_service.rs"]
mod order_service;

use std::time::Duration;

use pgoutbox::kafka::rdkafka::config::ClientConfig;
use pgoutbox::kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use pgoutbox::kafka::rdkafka::message::Message;
use pgoutbox::kafka::rdkafka::mocking::MockCluster;
use pgoutbox::kafka::{KafkaConfig, ENV_BROKERS};
use pgoutbox::postgres::{Inbox, Outbox, PgStore};
use pgoutbox::Relay;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use order_service::{ConsumeUntil, Error, OrderCreated, Pending};

const TOPIC: &str = "outbox-orders";

const ABOUT: &str = "Order service on Kafka: orders and their events commit in one transaction, a relay publishes them to the topic `outbox-orders`, a consumer processes each once.";
const AFTER_HELP: &str = "Without arguments it creates 5 orders. Kafka: OUTBOX_KAFKA_BROKERS and the other OUTBOX_KAFKA_* variables; without OUTBOX_KAFKA_BROKERS, librdkafka's in-process mock cluster.";

#[tokio::main]
async fn main() {
    order_service::init_tracing("info,sqlx=warn,rdkafka=warn");
    order_service::exit_on_error("kafka", run().await);
}

async fn run() -> Result<(), Error> {
    let orders = order_service::orders_arg("kafka", ABOUT, AFTER_HELP, Some(5));
    let db = order_service::connect("kafka").await?;

    // A real cluster from the environment, or librdkafka's mock cluster in-process.
    // Kept alive until the end: the relay and the consumer talk to it.
    let mut mock = None;
    let config = if std::env::var(ENV_BROKERS).is_ok_and(|b| !b.trim().is_empty()) {
        KafkaConfig::from_env()?
    } else {
        let cluster = MockCluster::new(1)?;
        cluster.create_topic(TOPIC, 3, 1)?;
        let brokers = cluster.bootstrap_servers();
        eprintln!("kafka: {ENV_BROKERS} is not set; started librdkafka's mock cluster at {brokers} (in-process, in memory)");
        mock = Some(cluster);
        KafkaConfig::new(brokers)
    };
    let brokers = config.brokers().to_string();
    if mock.is_none() {
        // A cluster that does not create topics on first use would refuse every event.
        config
            .ensure_topic(TOPIC, 3, Duration::from_secs(30))
            .await?;
    }
    let publisher = config.route_aggregate_type("order", TOPIC).build()?;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "outbox-example-billing")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[TOPIC])?;
    eprintln!("kafka: publishing to {brokers}, topic {TOPIC}");

    let outbox = Outbox::new(db.tables.clone());
    let store = PgStore::new(db.pool.clone(), db.tables.clone());
    let relay = Relay::new(store, publisher).with_config(order_service::relay_config());
    let inbox = Inbox::new(&outbox, "billing_kafka")?;

    let stop = order_service::stop_on_ctrl_c("kafka");
    let pending = Pending::default();
    let processed = order_service::run_service(
        &stop,
        relay.run(stop.clone().cancelled_owned()),
        order_service::produce("kafka", &db, &outbox, orders, Some(&pending), &stop),
        consume(
            &consumer,
            &db.pool,
            &inbox,
            orders.is_some(),
            &pending,
            &stop,
        ),
    )
    .await?;
    relay.publisher().flush(Duration::from_secs(5)).await?;
    eprintln!(
        "kafka: published {} events, processed {processed}, bye",
        relay.stats().snapshot().published
    );
    db.pool.close().await;
    // Clients first, then the mock cluster they talk to.
    drop(consumer);
    drop(relay);
    drop(mock);
    Ok(())
}

/// Process events once each (the inbox skips duplicates). In demo mode, return when
/// every event of this run was consumed (at most 60 s); otherwise at Ctrl-C.
async fn consume(
    consumer: &StreamConsumer,
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
            message = tokio::time::timeout(Duration::from_millis(200), consumer.recv()) => match message {
                Ok(message) => message,
                Err(_) => continue,
            },
        };
        let message = match message {
            Ok(message) => message,
            Err(error) => {
                eprintln!("kafka: consumer: {error}");
                continue;
            }
        };
        let meta = match pgoutbox::kafka::metadata(&message) {
            Ok(meta) => meta,
            Err(error) => {
                eprintln!("kafka: skipping a message: {error}");
                continue;
            }
        };
        let order: OrderCreated = match meta.decode(message.payload().unwrap_or_default()) {
            Ok(order) => order,
            Err(error) => {
                eprintln!("kafka: skipping a message: {error}");
                continue;
            }
        };
        if order_service::process(inbox, pool, meta.event_id, || {
            format!(
                "{} event {} (partition {}, offset {}): {order}",
                meta.event_type,
                meta.event_id,
                message.partition(),
                message.offset()
            )
        })
        .await?
        {
            processed += 1;
        }
        // Commit the offset only after the inbox transaction committed.
        consumer.commit_message(&message, CommitMode::Async)?;
        pending.consumed(meta.event_id);
    }
}
