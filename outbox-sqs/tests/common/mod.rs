//! Test helpers: moto's SQS endpoint, unique queues, a reader.
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use pgoutbox_sqs::aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use pgoutbox_sqs::aws_sdk_sqs::Client;
use pgoutbox_sqs::{SqsConfig, SqsPublisher};

/// moto's endpoint from `OUTBOX_SQS_ENDPOINT`; panics (the test fails) when unset or
/// not answering, so a missing moto is never mistaken for a pass.
pub fn endpoint() -> String {
    let endpoint = std::env::var("OUTBOX_SQS_ENDPOINT").unwrap_or_default();
    assert!(
        !endpoint.is_empty(),
        "OUTBOX_SQS_ENDPOINT is not set: start moto with `scripts/moto.sh cargo test -p pgoutbox-sqs` \
         (or `source scripts/moto.sh`)"
    );
    let authority = endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/');
    let reachable = std::net::ToSocketAddrs::to_socket_addrs(authority)
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|addr| {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok()
        });
    assert!(
        reachable,
        "nothing answers at OUTBOX_SQS_ENDPOINT={endpoint}: is moto running? (scripts/moto.sh)"
    );
    endpoint
}

/// moto's address, for a proxy in front of it.
pub fn moto_addr() -> std::net::SocketAddr {
    pgoutbox_core::testing::resolve_url(&endpoint())
}

/// A config for moto with static test credentials.
pub fn config(queue: &str) -> SqsConfig {
    SqsConfig::new(queue)
        .endpoint(endpoint())
        .region("us-east-1")
        .credentials("test", "test")
        .timeout(Duration::from_secs(10))
}

pub async fn publisher(queue: &str) -> SqsPublisher {
    config(queue).build().await.expect("sqs publisher")
}

/// A unique queue name (FIFO when `fifo`).
pub fn unique(prefix: &str, fifo: bool) -> String {
    let name = pgoutbox_core::testing::unique(prefix);
    if fifo {
        format!("{name}.fifo")
    } else {
        name
    }
}

/// Create a queue, return its URL.
pub async fn create_queue(client: &Client, name: &str) -> String {
    let mut create = client.create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let out = create.send().await.expect("create queue on moto");
    out.queue_url().expect("queue url").to_string()
}

/// A fresh queue named after `prefix` (FIFO when `fifo`) and a publisher to it by
/// name; returns the publisher and the queue's URL.
pub async fn new_queue(prefix: &str, fifo: bool) -> (SqsPublisher, String) {
    let name = unique(prefix, fifo);
    let publisher = publisher(&name).await;
    let url = create_queue(publisher.client(), &name).await;
    (publisher, url)
}

/// Read (and delete) up to `max` messages, waiting at most `wait` for the first ones.
pub async fn read(client: &Client, url: &str, max: usize, wait: Duration) -> Vec<Message> {
    let deadline = Instant::now() + wait;
    let mut out: Vec<Message> = Vec::new();
    while out.len() < max {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages((max - out.len()).min(10) as i32)
            .wait_time_seconds(left.as_secs().clamp(0, 1) as i32)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .expect("receive from moto");
        let messages = got.messages().to_vec();
        if messages.is_empty() {
            if !out.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        for m in &messages {
            if let Some(handle) = m.receipt_handle() {
                client
                    .delete_message()
                    .queue_url(url)
                    .receipt_handle(handle)
                    .send()
                    .await
                    .expect("delete on moto");
            }
        }
        out.extend(messages);
    }
    out
}
