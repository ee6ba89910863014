//! Order service on Amazon SQS: orders and their `order.created` events commit in one
//! PostgreSQL transaction; a relay publishes the events to an SQS FIFO queue; a
//! consumer in the same process reads them and processes each event id once with the inbox.
//!
//! ```text
//! scripts/moto.sh cargo run -p outbox-examples --features sqs --bin sqs                # 5 orders, then exit
//! scripts/moto.sh cargo run -p outbox-examples --features sqs --bin sqs -- --orders 20
//! scripts/moto.sh cargo run -p outbox-examples --features sqs --bin sqs -- --forever   # until Ctrl-C
//! ```
//!
//! `DATABASE_URL` defaults to `postgres://postgres@127.0.0.1:5432/test`. SQS settings
//! come from the `OUTBOX_SQS_*` variables: `OUTBOX_SQS_ENDPOINT` points at moto (as
//! `scripts/moto.sh` sets it); then, without AWS credentials or region in the
//! environment, the example uses moto's test credentials and `us-east-1`. The queue
//! (`OUTBOX_SQS_QUEUE`, default `outbox-orders.fifo`) is created when missing.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::postgres::{migrate, Inbox, Outbox, PgStore, Processed, Tables};
use outbox::sqs::aws_sdk_sqs::types::QueueAttributeName;
use outbox::sqs::{Received, SqsConfig, ENV_ENDPOINT, ENV_QUEUE};
use outbox::{NewEvent, Relay, RelayConfig};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const DEFAULT_QUEUE: &str = "outbox-orders.fifo";

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
                .unwrap_or_else(|_| "info,sqlx=warn,aws_config=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(error) = run().await {
        eprintln!("sqs: {error}");
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

    let queue = std::env::var(ENV_QUEUE)
        .ok()
        .filter(|q| !q.is_empty())
        .unwrap_or_else(|| DEFAULT_QUEUE.into());
    let endpoint = std::env::var(ENV_ENDPOINT).ok().filter(|e| !e.is_empty());
    let mut config = SqsConfig::from_env()?.queue(&queue);
    if endpoint.is_some() {
        if std::env::var("AWS_ACCESS_KEY_ID").is_err() {
            config = config.credentials("test", "test");
        }
        if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
            config = config.region("us-east-1");
        }
    }
    let publisher = config.build().await?;
    let client = publisher.client().clone();
    // Create the queue if needed (idempotent); FIFO: group = order id, dedup = event id.
    let mut create = client.create_queue().queue_name(&queue);
    if queue.ends_with(".fifo") {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let where_ = endpoint.as_deref().unwrap_or("AWS");
    let queue_url = create
        .send()
        .await
        .map_err(|e| {
            format!(
                "cannot create queue {queue} at {where_}: {e} (is moto running? scripts/moto.sh)"
            )
        })?
        .queue_url()
        .ok_or("CreateQueue returned no URL")?
        .to_string();
    eprintln!("sqs: publishing to {queue_url} ({where_})");

    let outbox = Outbox::new(tables.clone());
    let store = PgStore::new(pool.clone(), tables);
    let relay = Relay::new(store, publisher).with_config(RelayConfig {
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    });
    let inbox = Inbox::new(&outbox, "billing_sqs")?;

    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("sqs: Ctrl-C, finishing the batch in flight");
            }
            stop.cancel();
        }
    });
    let pending: Pending = Arc::default();
    let producer = produce(&pool, &outbox, orders, &pending, &stop);
    let consuming = consume(
        &client,
        &queue_url,
        &pool,
        &inbox,
        orders.is_some(),
        &pending,
        &stop,
    );
    let app = async {
        let result = tokio::try_join!(producer, consuming);
        stop.cancel();
        result
    };
    let ((), app) = tokio::join!(relay.run(stop.clone().cancelled_owned()), app);
    let ((), processed) = app?;
    eprintln!(
        "sqs: published {} events, processed {processed}, bye",
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
            "sqs: created order {order_id} for {customer} (event {})",
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

/// Process events once each (the inbox skips duplicates), deleting each message after
/// its inbox transaction committed. In demo mode, return when every event of this run
/// was consumed (at most 60 s); otherwise at Ctrl-C.
async fn consume(
    client: &outbox::sqs::aws_sdk_sqs::Client,
    queue_url: &str,
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
        let receive = client
            .receive_message()
            .queue_url(queue_url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .send();
        let received = tokio::select! {
            () = stop.cancelled() => return Ok(processed),
            () = tokio::time::sleep_until(deadline), if demo => {
                return Err("not every event was consumed within 60 s".into());
            }
            received = receive => received,
        };
        let received = match received {
            Ok(received) => received,
            Err(error) => {
                eprintln!("sqs: receive: {error}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        for message in received.messages() {
            let meta = match Received::from_message(message) {
                Ok(meta) => meta,
                Err(error) => {
                    eprintln!("sqs: skipping a message: {error}");
                    continue;
                }
            };
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
                        "billing: {} {}/{} event {} {}",
                        meta.event_type,
                        meta.aggregate_type,
                        meta.aggregate_id,
                        meta.event_id,
                        message.body().unwrap_or_default()
                    );
                }
                Processed::Duplicate => {
                    println!("billing: duplicate event {} skipped", meta.event_id)
                }
            }
            if let Some(handle) = message.receipt_handle() {
                client
                    .delete_message()
                    .queue_url(queue_url)
                    .receipt_handle(handle)
                    .send()
                    .await?;
            }
            lock(pending).0.remove(&meta.event_id);
        }
    }
}
