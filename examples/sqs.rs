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

#[path = "shared/order_service.rs"]
mod order_service;

use std::time::Duration;

use pgoutbox::sqs::aws_sdk_sqs::types::{Message as SqsMessage, QueueAttributeName};
use pgoutbox::sqs::aws_sdk_sqs::Client;
use pgoutbox::sqs::{Metadata, SqsConfig, ENV_ENDPOINT, ENV_QUEUE};

use order_service::{Database, Deliveries, Error, Example};

const DEFAULT_QUEUE: &str = "outbox-orders.fifo";

const EXAMPLE: Example = Example {
    name: "sqs",
    about: "Order service on Amazon SQS: orders and their events commit in one transaction, a relay publishes them to a FIFO queue, a consumer processes each once.",
    after_help: "Without arguments it creates 5 orders. SQS: the OUTBOX_SQS_* variables; OUTBOX_SQS_ENDPOINT points at moto (scripts/moto.sh sets it); the queue OUTBOX_SQS_QUEUE (default outbox-orders.fifo) is created when missing.",
    default_orders: Some(5),
    log_filter: "info,sqlx=warn,aws_config=warn",
};

#[tokio::main]
async fn main() {
    order_service::main(EXAMPLE, run).await;
}

async fn run(db: Database, orders: Option<u32>) -> Result<(), Error> {
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

    order_service::serve(
        "sqs",
        &db,
        publisher,
        "billing_sqs",
        orders,
        Queue {
            client: &client,
            url: &queue_url,
        },
    )
    .await?;
    Ok(())
}

/// The queue's messages, up to 10 per long poll of 1 s; each deleted once its
/// event is processed.
struct Queue<'c> {
    client: &'c Client,
    url: &'c str,
}

impl Deliveries for Queue<'_> {
    type Message = SqsMessage;

    async fn next(&mut self) -> Result<Vec<SqsMessage>, Error> {
        let received = self
            .client
            .receive_message()
            .queue_url(self.url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .send()
            .await;
        match received {
            Ok(received) => Ok(received.messages.unwrap_or_default()),
            Err(error) => {
                eprintln!("sqs: receive: {error}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok(Vec::new())
            }
        }
    }

    fn metadata(&self, message: &SqsMessage) -> Result<Metadata, Error> {
        Ok(pgoutbox::sqs::metadata(message)?)
    }

    fn body<'m>(&self, message: &'m SqsMessage) -> &'m [u8] {
        message.body().unwrap_or_default().as_bytes()
    }

    async fn settle(&mut self, message: SqsMessage) -> Result<(), Error> {
        if let Some(handle) = message.receipt_handle() {
            self.client
                .delete_message()
                .queue_url(self.url)
                .receipt_handle(handle)
                .send()
                .await?;
        }
        Ok(())
    }
}
