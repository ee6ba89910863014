//! `broker.kind = "kafka"`: Kafka, `[broker.kafka]` is [`KafkaSettings`].

use std::sync::Arc;
use std::time::Duration;

use pgoutbox_core::settings::EnvOverrides;
use pgoutbox_core::DynPublisher;
use pgoutbox_kafka::{KafkaConfig, KafkaSettings};

use super::{BoxError, BrokerError, BrokerFactory, BrokerInput, BuildFuture};

/// Longest wait for a Kafka topic to be created and get its partition leaders.
const TOPIC_TIMEOUT: Duration = Duration::from_secs(30);

/// The Kafka broker's factory.
pub(super) struct Kafka;

impl Kafka {
    /// The adapter's config, and the partitions of topics to create when missing.
    fn config(input: &BrokerInput) -> Result<(KafkaConfig, Option<i32>), BoxError> {
        let settings = input.parse::<KafkaSettings>()?.with_env()?;
        let mut config = KafkaConfig::from_settings(&settings)?.envelope(input.envelope().clone());
        for (event_type, topic) in input.routes_by_event_type() {
            config = config.route_event_type(event_type, topic);
        }
        for (aggregate_type, topic) in input.routes_by_aggregate_type() {
            config = config.route_aggregate_type(aggregate_type, topic);
        }
        match settings.create_topics_with_partitions {
            Some(n) if n < 1 => {
                Err(format!("create_topics_with_partitions = {n}: expected at least 1").into())
            }
            Some(_) if config.named_topics().is_empty() => Err(
                "create_topics_with_partitions names no topic: set topic or [routing] rules".into(),
            ),
            partitions => Ok((config, partitions)),
        }
    }
}

impl BrokerFactory for Kafka {
    fn check(&self, input: &BrokerInput) -> Result<(), BoxError> {
        Self::config(input).map(drop)
    }

    fn build(&self, input: BrokerInput) -> BuildFuture {
        Box::pin(async move {
            let (config, partitions) = Self::config(&input).map_err(BrokerError::Invalid)?;
            if let (true, Some(partitions)) = (input.creates_missing(), partitions) {
                for topic in config.named_topics() {
                    config
                        .ensure_topic(&topic, partitions, TOPIC_TIMEOUT)
                        .await
                        .map_err(|e| BrokerError::Unavailable(e.into()))?;
                    tracing::info!(%topic, partitions, "kafka topic ready");
                }
            }
            let publisher = config.build().map_err(|e| BrokerError::Invalid(e.into()))?;
            let publisher: Arc<dyn DynPublisher> = Arc::new(publisher);
            Ok(publisher)
        })
    }
}
