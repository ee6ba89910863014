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
//! Events go to the topic `outbox-orders`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::kafka::rdkafka::config::ClientConfig;
use outbox::kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use outbox::kafka::rdkafka::message::Message;
use outbox::kafka::rdkafka::mocking::MockCluster;
use outbox::kafka::{KafkaConfig, Received, ENV_BROKERS};
use outbox::postgres::{migrate, Inbox, Outbox, PgStore, Processed, Tables};
use outbox::{NewEvent, Relay, RelayConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const TOPIC: &str = "outbox-orders";

/// Event ids committed by this run and not consumed yet, and whether all are committed.
type Pending = Arc<Mutex<(HashSet<Uuid>, bool)>>;

fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, (HashSet<Uuid>, bool)> {
    pending
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn,rdkafka=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(error) = run().await {
        eprintln!("kafka: {error}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let orders: Option<u32> = if args.iter().any(|a| a == "--forever") {
        None
    } else {
        match args.iter().skip_while(|a| *a != "--orders").nth(1) {
            Some(n) => Some(
                n.parse()
                    .map_err(|_| format!("--orders expects a number, got {n:?}"))?,
            ),
            None => Some(5),
        }
    };
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_string());
    let pool = PgStore::connect(&url, 4, Duration::from_secs(60))
        .await
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
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
    let publisher = config.route_aggregate_type("order", TOPIC).build()?;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "outbox-example-billing")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[TOPIC])?;
    eprintln!("kafka: publishing to {brokers}, topic {TOPIC}");

    let outbox = Outbox::new(tables.clone());
    let store = PgStore::new(pool.clone(), tables);
    let relay = Relay::new(store, publisher).with_config(RelayConfig {
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    });
    let inbox = Inbox::new(&outbox, "billing_kafka")?;

    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("kafka: Ctrl-C, finishing the batch in flight");
            }
            stop.cancel();
        }
    });
    let pending: Pending = Arc::default();
    let producer = produce(&pool, &outbox, orders, &pending, &stop);
    let consuming = consume(&consumer, &pool, &inbox, orders.is_some(), &pending, &stop);
    let app = async {
        let result = tokio::try_join!(producer, consuming);
        stop.cancel();
        result
    };
    let ((), app) = tokio::join!(relay.run(stop.clone().cancelled_owned()), app);
    let ((), processed) = app?;
    relay.publisher().flush(Duration::from_secs(5)).await?;
    eprintln!(
        "kafka: published {} events, processed {processed}, bye",
        relay.stats().snapshot().published
    );
    pool.close().await;
    // Clients first, then the mock cluster they talk to.
    drop(consumer);
    drop(relay);
    drop(mock);
    Ok(())
}

/// Create orders, each with its event in the same transaction: `count` of them, or one
/// a second until Ctrl-C.
async fn produce(
    pool: &PgPool,
    outbox: &Outbox,
    count: Option<u32>,
    pending: &Pending,
    stop: &CancellationToken,
) -> Result<(), Box<dyn std::error::Error>> {
    let customers = ["ada", "grace", "linus", "barbara"];
    let mut n: u32 = 0;
    while !stop.is_cancelled() && count.map_or(true, |c| n < c) {
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
        // Before the commit: the consumer may see the event right after it.
        lock(pending).0.insert(event.id);
        tx.commit().await?;
        eprintln!(
            "kafka: created order {order_id} for {customer} (event {})",
            event.id
        );
        n += 1;
        if count.is_none() {
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
    lock(pending).1 = true;
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
) -> Result<u64, Box<dyn std::error::Error>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut processed = 0;
    loop {
        if demo {
            let pending = lock(pending);
            if pending.1 && pending.0.is_empty() {
                return Ok(processed);
            }
        }
        let message = tokio::select! {
            () = stop.cancelled() => return Ok(processed),
            () = tokio::time::sleep_until(deadline), if demo => {
                return Err("not every event was consumed within 60 s".into());
            }
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
        let meta = match Received::from_message(&message) {
            Ok(meta) => meta,
            Err(error) => {
                eprintln!("kafka: skipping a message: {error}");
                continue;
            }
        };
        let payload = String::from_utf8_lossy(message.payload().unwrap_or_default()).into_owned();
        let outcome = inbox
            .process(pool, meta.event_id, |_conn| {
                // Business effects go here, on `_conn`, in the inbox's transaction.
                Box::pin(async { Ok::<(), sqlx::Error>(()) })
            })
            .await?;
        match outcome {
            Processed::First(()) => {
                processed += 1;
                println!(
                    "billing: {} {}/{} event {} (partition {}, offset {}) {payload}",
                    meta.event_type,
                    meta.aggregate_type,
                    meta.aggregate_id,
                    meta.event_id,
                    message.partition(),
                    message.offset()
                );
            }
            Processed::Duplicate => println!("billing: duplicate event {} skipped", meta.event_id),
        }
        // Commit the offset only after the inbox transaction committed.
        consumer.commit_message(&message, CommitMode::Async)?;
        lock(pending).0.remove(&meta.event_id);
    }
}
