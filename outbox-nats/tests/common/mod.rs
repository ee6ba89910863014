//! Shared by the NATS integration tests: a unique stream per test on the real server.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use pgoutbox_core::conformance::proxy::TcpProxy;
use pgoutbox_core::conformance::{BoxError, ConformanceTarget, OutageTarget, ReceivedMessage};
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::Event;
use pgoutbox_nats::async_nats::jetstream::stream::StorageType;
use pgoutbox_nats::{EventConsumer, EventMessage, NatsConfig, NatsPublisher, SubjectRouting};

pub use pgoutbox_nats::testing::nats_url;

/// Its address, for the proxy.
pub fn nats_addr() -> SocketAddr {
    pgoutbox_core::testing::resolve_url(&nats_url())
}

/// A fresh subject prefix and in-memory stream capturing it, plus a durable consumer.
pub struct NatsTarget {
    pub prefix: String,
    pub stream: String,
    /// Publisher on the real server (also used for administration).
    pub admin: NatsPublisher,
    pub consumer: EventConsumer,
    /// In front of the server, for the outage checks.
    pub proxy: TcpProxy,
    /// The envelope of the publishers under test.
    pub envelope: Envelope,
}

impl NatsTarget {
    pub async fn new() -> Self {
        Self::with_envelope(Envelope::Outbox).await
    }

    /// A target whose publishers under test encode with `envelope`.
    pub async fn with_envelope(envelope: Envelope) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let prefix = format!("outbox_test_{id}");
        let stream = format!("OUTBOX_TEST_{id}");
        let admin = Self::config_for(&prefix, &nats_url())
            .connect()
            .await
            .unwrap_or_else(|e| panic!("NATS with JetStream must run at {}: {e}", nats_url()));
        let mut config = admin.stream_config(&stream);
        config.storage = StorageType::Memory;
        config.max_age = Duration::from_secs(600);
        admin
            .ensure_stream(config)
            .await
            .expect("create test stream");
        let consumer = EventConsumer::durable(admin.jetstream(), &stream, "test", "")
            .await
            .expect("create test consumer");
        Self {
            prefix,
            stream,
            admin,
            consumer,
            proxy: TcpProxy::start(nats_addr()).expect("proxy in front of NATS"),
            envelope,
        }
    }

    /// Settings to publish into this target's stream through the proxy (which
    /// `OutageTarget::cut` cuts).
    pub fn proxied_config(&self) -> NatsConfig {
        self.config(&format!("nats://{}", self.proxy.addr()))
    }

    /// Settings to publish into this target's stream via `url`.
    pub fn config(&self, url: &str) -> NatsConfig {
        Self::config_for(&self.prefix, url).envelope(self.envelope.clone())
    }

    fn config_for(prefix: &str, url: &str) -> NatsConfig {
        NatsConfig::new(url)
            .routing(SubjectRouting::new(prefix))
            .timeout(Duration::from_secs(5))
    }

    /// Messages in the stream now.
    pub async fn stored(&self) -> u64 {
        let mut stream = self
            .admin
            .jetstream()
            .get_stream(&self.stream)
            .await
            .expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Fetch and ack up to `max` outbox messages, waiting at most `wait`.
    pub async fn fetch(&self, max: usize, wait: Duration) -> Vec<EventMessage> {
        let mut out = Vec::new();
        for message in self.consumer.fetch(max, wait).await.expect("fetch") {
            let message = message.expect("an outbox event");
            message.ack().await.expect("ack");
            out.push(message);
        }
        out
    }

    pub async fn delete(&self) {
        let _ = self.admin.jetstream().delete_stream(&self.stream).await;
    }
}

impl ConformanceTarget for NatsTarget {
    type Publisher = NatsPublisher;

    async fn publisher(&self) -> Result<NatsPublisher, BoxError> {
        Ok(self.config(&nats_url()).connect().await?)
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
        let mut out = Vec::new();
        for message in self.consumer.fetch(max, wait).await? {
            let message = message?;
            message.ack().await?;
            out.push(ReceivedMessage::new(
                message.metadata,
                &message.message.payload,
            )?);
        }
        Ok(out)
    }

    fn refused(&self, mut event: Event) -> Event {
        // Over the server's default max_payload of 1 MiB.
        event.payload = pgoutbox_core::conformance::raw_json(&serde_json::json!({
            "blob": "x".repeat(1_100_000)
        }));
        event
    }

    async fn unreachable_publisher(&self) -> Result<NatsPublisher, BoxError> {
        let url = format!(
            "nats://127.0.0.1:{}",
            pgoutbox_core::conformance::proxy::closed_port()
        );
        Ok(self
            .config(&url)
            .timeout(Duration::from_secs(2))
            .build()
            .await?)
    }
}

impl OutageTarget for NatsTarget {
    async fn outage_publisher(&self) -> Result<NatsPublisher, BoxError> {
        Ok(self
            .proxied_config()
            .timeout(Duration::from_millis(700))
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
