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
use pgoutbox::kafka::rdkafka::message::{BorrowedMessage, Message};
use pgoutbox::kafka::rdkafka::mocking::MockCluster;
use pgoutbox::kafka::{KafkaConfig, Metadata, ENV_BROKERS};

use order_service::{Database, Deliveries, Error, Example};

const TOPIC: &str = "outbox-orders";

const EXAMPLE: Example = Example {
    name: "kafka",
    about: "Order service on Kafka: orders and their events commit in one transaction, a relay publishes them to the topic `outbox-orders`, a consumer processes each once.",
    after_help: "Without arguments it creates 5 orders. Kafka: OUTBOX_KAFKA_BROKERS and the other OUTBOX_KAFKA_* variables; without OUTBOX_KAFKA_BROKERS, librdkafka's in-process mock cluster.",
    default_orders: Some(5),
    log_filter: "info,sqlx=warn,rdkafka=warn",
};

#[tokio::main]
async fn main() {
    order_service::main(EXAMPLE, run).await;
}

async fn run(db: Database, orders: Option<u32>) -> Result<(), Error> {
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

    let relay = order_service::serve(
        "kafka",
        &db,
        publisher,
        "billing_kafka",
        orders,
        Topic(&consumer),
    )
    .await?;
    relay.publisher().flush(Duration::from_secs(5)).await?;
    // Clients first, then the mock cluster they talk to.
    drop(consumer);
    drop(relay);
    drop(mock);
    Ok(())
}

/// The topic's messages; each offset is committed once its event is processed
/// (the inbox transaction committed).
struct Topic<'c>(&'c StreamConsumer);

impl<'c> Deliveries for Topic<'c> {
    type Message = BorrowedMessage<'c>;

    async fn next(&mut self) -> Result<Vec<BorrowedMessage<'c>>, Error> {
        // Wake up now and then to see whether the demo is complete.
        match tokio::time::timeout(Duration::from_millis(200), self.0.recv()).await {
            Err(_) => Ok(Vec::new()),
            Ok(Ok(message)) => Ok(vec![message]),
            Ok(Err(error)) => {
                eprintln!("kafka: consumer: {error}");
                Ok(Vec::new())
            }
        }
    }

    fn metadata(&self, message: &BorrowedMessage<'c>) -> Result<Metadata, Error> {
        Ok(pgoutbox::kafka::metadata(message)?)
    }

    fn body<'m>(&self, message: &'m BorrowedMessage<'c>) -> &'m [u8] {
        message.payload().unwrap_or_default()
    }

    fn place(&self, message: &BorrowedMessage<'c>) -> String {
        format!(
            " (partition {}, offset {})",
            message.partition(),
            message.offset()
        )
    }

    async fn settle(&mut self, message: BorrowedMessage<'c>) -> Result<(), Error> {
        Ok(self.0.commit_message(&message, CommitMode::Async)?)
    }
}
