//! Shared by the AMQP integration tests: a unique exchange and queue per test on the
//! real RabbitMQ.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pgoutbox_amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use pgoutbox_amqp::lapin::types::FieldTable;
use pgoutbox_amqp::lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use pgoutbox_amqp::{AmqpConfig, AmqpPublisher, AmqpRouting, Metadata};
use pgoutbox_core::conformance::proxy::TcpProxy;
use pgoutbox_core::conformance::{BoxError, ConformanceTarget, OutageTarget, ReceivedMessage};
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::Event;

/// The broker under test: `AMQP_URL`, or the local RabbitMQ.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The local RabbitMQ's address, for the proxy.
pub fn amqp_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 5672))
}

/// The same broker through `addr` (a proxy).
pub fn url_via(addr: SocketAddr) -> String {
    format!("amqp://guest:guest@{addr}/%2f")
}

/// Routing keys bound to the test queue; anything else is unroutable.
pub const BOUND: [&str; 2] = ["conformance.#", "order.#"];

/// A fresh topic exchange and a queue bound to it for [`BOUND`].
pub struct AmqpTarget {
    pub exchange: String,
    pub queue: String,
    connection: Connection,
    channel: Channel,
    /// In front of the broker, for the outage checks.
    proxy: TcpProxy,
    /// The envelope of the publishers under test.
    envelope: Envelope,
}

impl AmqpTarget {
    pub async fn new() -> Self {
        Self::with_envelope(Envelope::Outbox).await
    }

    /// A target whose publishers under test encode with `envelope`.
    pub async fn with_envelope(envelope: Envelope) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let exchange = format!("outbox_test_{id}");
        let queue = format!("outbox_test_{id}");
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ must run at {}: {e}", amqp_url()));
        let channel = connection.create_channel().await.expect("channel");
        channel
            .exchange_declare(
                &exchange,
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        channel
            .queue_declare(
                &queue,
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare queue");
        for key in BOUND {
            channel
                .queue_bind(
                    &queue,
                    &exchange,
                    key,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("bind queue");
        }
        Self {
            exchange,
            queue,
            connection,
            channel,
            proxy: TcpProxy::start(amqp_addr()).expect("proxy in front of RabbitMQ"),
            envelope,
        }
    }

    /// Settings to publish into this target's exchange via `url`.
    pub fn config(&self, url: &str) -> AmqpConfig {
        AmqpConfig::new(url)
            .routing(AmqpRouting::new(&self.exchange))
            .timeout(Duration::from_secs(5))
            .envelope(self.envelope.clone())
    }

    /// Get and ack up to `max` deliveries, waiting at most `wait` for the first.
    pub async fn get(&self, max: usize, wait: Duration) -> Vec<(Metadata, Vec<u8>)> {
        let deadline = Instant::now() + wait;
        let mut out = Vec::new();
        loop {
            while out.len() < max {
                let Some(message) = self
                    .channel
                    .basic_get(&self.queue, BasicGetOptions::default())
                    .await
                    .expect("basic.get")
                else {
                    break;
                };
                message.ack(BasicAckOptions::default()).await.expect("ack");
                let metadata = pgoutbox_amqp::metadata(&message).expect("an outbox event");
                out.push((metadata, message.delivery.data.clone()));
            }
            if !out.is_empty() || Instant::now() >= deadline {
                return out;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn delete(&self) {
        let _ = self
            .channel
            .queue_delete(&self.queue, QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(&self.exchange, ExchangeDeleteOptions::default())
            .await;
        let _ = self.connection.close(0, "test done").await;
    }
}

impl ConformanceTarget for AmqpTarget {
    type Publisher = AmqpPublisher;

    async fn publisher(&self) -> Result<AmqpPublisher, BoxError> {
        Ok(self.config(&amqp_url()).connect().await?)
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
        let mut out = Vec::new();
        for (metadata, body) in self.get(max, wait).await {
            out.push(ReceivedMessage::new(metadata, &body)?);
        }
        Ok(out)
    }

    fn refused(&self, mut event: Event) -> Event {
        // No queue is bound for this routing key: `mandatory` makes it come back.
        event.destination = Some(format!("unbound.{}", event.id));
        event
    }

    async fn unreachable_publisher(&self) -> Result<AmqpPublisher, BoxError> {
        let url = format!(
            "amqp://guest:guest@127.0.0.1:{}/%2f",
            pgoutbox_core::conformance::proxy::closed_port()
        );
        Ok(self.config(&url).timeout(Duration::from_secs(2)).build()?)
    }
}

impl OutageTarget for AmqpTarget {
    async fn outage_publisher(&self) -> Result<AmqpPublisher, BoxError> {
        Ok(self
            .config(&url_via(self.proxy.addr()))
            .timeout(Duration::from_secs(2))
            .connect()
            .await?)
    }

    fn cut(&self) {
        self.proxy.cut();
    }

    fn restore(&self) {
        self.proxy.restore();
    }
}
