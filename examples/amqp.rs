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

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, QueueBindOptions, QueueDeclareOptions,
};
use outbox::amqp::lapin::types::FieldTable;
use outbox::amqp::lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox::amqp::{AmqpConfig, Metadata};
use outbox::postgres::{migrate, Inbox, Outbox, PgStore, Processed, Tables};
use outbox::{NewEvent, Relay, RelayConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const QUEUE: &str = "billing";

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
                .unwrap_or_else(|_| "info,sqlx=warn,lapin=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(error) = run().await {
        eprintln!("amqp: {error}");
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

    let outbox = Outbox::new(tables.clone());
    let store = PgStore::new(pool.clone(), tables);
    let relay = Relay::new(store, publisher).with_config(RelayConfig {
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    });
    let inbox = Inbox::new(&outbox, "billing")?;

    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("amqp: Ctrl-C, finishing the batch in flight");
            }
            stop.cancel();
        }
    });
    let pending: Pending = Arc::default();
    let producer = produce(&pool, &outbox, orders, &pending, &stop);
    let consumer = consume(&channel, &pool, &inbox, orders.is_some(), &pending, &stop);
    let app = async {
        let result = tokio::try_join!(producer, consumer);
        stop.cancel();
        result
    };
    let ((), app) = tokio::join!(relay.run(stop.clone().cancelled_owned()), app);
    let ((), processed) = app?;
    let _ = connection.close(0, "bye").await;
    eprintln!(
        "amqp: published {} events, processed {processed}, bye",
        relay.stats().snapshot().published
    );
    pool.close().await;
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
            "amqp: created order {order_id} for {customer} (event {})",
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
    channel: &Channel,
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
            message = channel.basic_get(QUEUE, BasicGetOptions::default()) => message?,
        };
        // basic.get keeps the example short; a service would use basic_consume.
        let Some(message) = message else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let meta = match Metadata::from_delivery(&message) {
            Ok(meta) => meta,
            Err(error) => {
                eprintln!("amqp: skipping a message: {error}");
                message.ack(BasicAckOptions::default()).await?;
                continue;
            }
        };
        let payload = String::from_utf8_lossy(&message.data).into_owned();
        let outcome = inbox
            .process(pool, meta.id, |_conn| {
                // Business effects go here, on `_conn`, in the inbox's transaction.
                Box::pin(async { Ok::<(), sqlx::Error>(()) })
            })
            .await?;
        match outcome {
            Processed::First(()) => {
                processed += 1;
                println!(
                    "billing: {} {}/{} event {} {payload}",
                    meta.event_type, meta.aggregate_type, meta.aggregate_id, meta.id
                );
            }
            Processed::Duplicate => println!("billing: duplicate event {} skipped", meta.id),
        }
        message.ack(BasicAckOptions::default()).await?;
        lock(pending).0.remove(&meta.id);
    }
}
