//! The shared publisher conformance suite against librdkafka's mock cluster and
//! against tansu, a Kafka-protocol broker process (scripts/tansu.sh starts it).

mod common;

use std::time::Duration;

use common::{consumer, create_topic, read, tansu_bootstrap, unique, MockKafka};
use pgoutbox_core::conformance::proxy::closed_port;
use pgoutbox_core::conformance::{
    self, BoxError, ConformanceTarget, OutageTarget, ReceivedMessage,
};
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::Event;
use pgoutbox_kafka::rdkafka::consumer::StreamConsumer;
use pgoutbox_kafka::rdkafka::message::Message;
use pgoutbox_kafka::{KafkaConfig, KafkaPublisher};

const PARTITIONS: i32 = 3;

struct Kafka {
    // Dropped before the mock cluster: they talk to it.
    consumer: StreamConsumer,
    topic: String,
    bootstrap: String,
    /// The mock cluster, or `None` for a broker running on its own (tansu).
    mock: Option<MockKafka>,
    /// The envelope of the publishers under test.
    envelope: Envelope,
}

impl Kafka {
    fn mock() -> Self {
        let (mock, topic) = MockKafka::with_topic(1, "conformance", PARTITIONS);
        Self {
            consumer: consumer(mock.bootstrap(), &topic, PARTITIONS),
            topic,
            bootstrap: mock.bootstrap().to_string(),
            mock: Some(mock),
            envelope: Envelope::Outbox,
        }
    }

    async fn tansu() -> Self {
        Self::tansu_with(Envelope::Outbox).await
    }

    /// A topic on tansu, published to with `envelope`.
    async fn tansu_with(envelope: Envelope) -> Self {
        let bootstrap = tansu_bootstrap();
        let topic = unique("conformance");
        create_topic(&bootstrap, &topic, PARTITIONS).await;
        Self {
            consumer: consumer(&bootstrap, &topic, PARTITIONS),
            topic,
            bootstrap,
            mock: None,
            envelope,
        }
    }
}

impl ConformanceTarget for Kafka {
    type Publisher = KafkaPublisher;

    async fn publisher(&self) -> Result<KafkaPublisher, BoxError> {
        Ok(KafkaConfig::new(&self.bootstrap)
            .topic(&self.topic)
            .delivery_timeout(Duration::from_secs(10))
            .envelope(self.envelope.clone())
            .build()?)
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
        let mut out = Vec::new();
        // The first message may take `wait`; the rest of a burst comes at once.
        let first = read(&self.consumer, 1, wait).await;
        let rest = if first.is_empty() {
            Vec::new()
        } else {
            read(
                &self.consumer,
                max.saturating_sub(1),
                Duration::from_millis(200),
            )
            .await
        };
        for message in first.into_iter().chain(rest) {
            let metadata = pgoutbox_kafka::metadata(&message)?;
            out.push(ReceivedMessage::new(
                metadata,
                message.payload().unwrap_or_default(),
            )?);
        }
        Ok(out)
    }

    fn refused(&self, mut event: Event) -> Event {
        // Over librdkafka's default message.max.bytes (1,000,000).
        let big = "x".repeat(1_100_000);
        event.payload = conformance::raw_json(&serde_json::json!({ "big": big }));
        event
    }

    async fn unreachable_publisher(&self) -> Result<KafkaPublisher, BoxError> {
        Ok(KafkaConfig::new(format!("127.0.0.1:{}", closed_port()))
            .topic(&self.topic)
            .delivery_timeout(Duration::from_secs(3))
            .build()?)
    }
}

/// The mock cluster's broker goes down and comes back; tansu runs on its own and
/// cannot be taken away by a test (a proxy would be bypassed: Kafka clients connect
/// to the broker address the cluster advertises).
impl OutageTarget for Kafka {
    async fn outage_publisher(&self) -> Result<KafkaPublisher, BoxError> {
        Ok(KafkaConfig::new(&self.bootstrap)
            .topic(&self.topic)
            .delivery_timeout(Duration::from_secs(2))
            .set("reconnect.backoff.max.ms", "500")
            .build()?)
    }

    fn cut(&self) {
        self.cluster().broker_down(1);
    }

    fn restore(&self) {
        self.cluster().broker_up(1);
    }
}

impl Kafka {
    fn cluster(&self) -> &MockKafka {
        self.mock
            .as_ref()
            .expect("outage checks run on the mock cluster only")
    }
}

mod mock_cluster {
    use super::Kafka;
    pgoutbox_core::conformance_tests!(Kafka::mock());
    pgoutbox_postgres::relay_conformance_tests!(Kafka::mock());
}

mod tansu {
    use super::Kafka;
    pgoutbox_core::conformance_tests!(Kafka::tansu().await);
    // No outage check on tansu (see `OutageTarget for Kafka`).
    pgoutbox_postgres::relay_conformance_tests!(Kafka::tansu().await, |_| async {}, no_outage);
    pgoutbox_core::conformance_tests!(@envelopes Kafka::tansu_with, |_| async {});
}
