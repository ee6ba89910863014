//! Creating the topics the publisher writes to, for clusters that do not create
//! topics on first use (`auto.create.topics.enable=false`, most managed Kafka, tansu).
//! Without the topic, every event routed to it fails permanently and is dead-lettered.
//! And deleting a topic, for tools that make one per run (the benchmark).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use crate::config::KafkaConfig;
use crate::error::{Error, Result};

/// Pause between two metadata reads while waiting for a new topic's partitions.
const METADATA_POLL: Duration = Duration::from_millis(200);

impl KafkaConfig {
    /// Create `topic` with `partitions` partitions unless it exists (with the
    /// cluster's default replication factor), then wait until the cluster reports
    /// every partition with a leader, all within `timeout`. An existing topic is
    /// left as it is, whatever its partition count.
    pub async fn ensure_topic(
        &self,
        topic: &str,
        partitions: i32,
        timeout: Duration,
    ) -> Result<()> {
        let failed = |reason: String| Error::TopicNotCreated {
            topic: topic.to_string(),
            reason,
        };
        let deadline = Instant::now() + timeout;
        let admin: Arc<AdminClient<DefaultClientContext>> =
            Arc::new(self.client_config()?.create()?);
        // `-1`: the broker's `default.replication.factor` (Kafka 2.4 and later).
        let new_topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
        let options = AdminOptions::new().operation_timeout(Some(timeout));
        let results = admin.create_topics([&new_topic], &options).await?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, code)) => return Err(failed(format!("cannot create it: {code}"))),
            }
        }
        loop {
            let reader = Arc::clone(&admin);
            let name = topic.to_string();
            // librdkafka's metadata call blocks: keep it off the async workers.
            let ready = tokio::task::spawn_blocking(move || {
                reader
                    .inner()
                    .fetch_metadata(Some(&name), Duration::from_secs(2))
                    .map(|metadata| {
                        metadata.topics().iter().any(|t| {
                            t.name() == name
                                && t.error().is_none()
                                && !t.partitions().is_empty()
                                && t.partitions().iter().all(|p| p.leader() >= 0)
                        })
                    })
            })
            .await
            .map_err(|e| failed(format!("metadata task: {e}")))?;
            if matches!(ready, Ok(true)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let why = match ready {
                    Err(e) => format!("metadata: {e}"),
                    Ok(_) => "no leader for every partition yet".to_string(),
                };
                return Err(failed(format!("not usable within {timeout:?}: {why}")));
            }
            tokio::time::sleep(METADATA_POLL).await;
        }
    }

    /// Delete `topic`, waiting up to `timeout` for the cluster's answer. A topic
    /// that does not exist is not an error. For tools that create a topic per run
    /// (the benchmark's `drain-broker --broker kafka`); the publisher and the
    /// `outbox` binary never delete topics.
    pub async fn delete_topic(&self, topic: &str, timeout: Duration) -> Result<()> {
        let failed = |reason: String| Error::TopicNotDeleted {
            topic: topic.to_string(),
            reason,
        };
        let admin: AdminClient<DefaultClientContext> = self.client_config()?.create()?;
        let options = AdminOptions::new()
            .operation_timeout(Some(timeout))
            .request_timeout(Some(timeout));
        let results = admin
            .delete_topics(&[topic], &options)
            .await
            .map_err(|e| failed(e.to_string()))?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                Err((_, code)) => return Err(failed(code.to_string())),
            }
        }
        Ok(())
    }
}
