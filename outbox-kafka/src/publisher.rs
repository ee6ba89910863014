//! [`KafkaPublisher`]: events to Kafka through an idempotent librdkafka producer.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::{Event, Outcome, PublishError, Publisher, RunOrder, RunOutcome};
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::KafkaConfig;
use crate::envelope;
use crate::error::{Error, Result};
use crate::routing::Topics;

/// Pause between attempts to queue a message while librdkafka's queue is full.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);

/// Longest wait of [`Publisher::check`] for the cluster's metadata.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// Publishes events to Kafka: topic by routing rule, key = aggregate id, payload =
/// the JSON payload, outbox metadata in headers (see [`crate::headers::EVENT_ID`] and
/// the other header constants).
///
/// All messages of a batch are queued in order and in flight at once; each event's
/// outcome is its delivery report. Events of one aggregate share a key, hence a
/// partition, and the idempotent producer keeps their order.
///
/// An aggregate's run goes out pipelined too ([`RunOrder::Pipelined`]): the
/// idempotent producer numbers the messages of a partition and the broker refuses
/// one that does not follow the last it wrote, so no message of the run is written
/// after a failed one; with `enable.gapless.guarantee` a failure that would leave a
/// gap stops the producer (fatal error; it is recreated) instead of going on. The
/// one exception librdkafka states: messages that fail by `message.timeout.ms`
/// ([`crate::KafkaConfig::delivery_timeout`]) are outside that guarantee, so keep
/// the delivery timeout well above the time a broker takes to come back or fail
/// over; such a case is logged as an error by the relay's publisher.
///
/// Failure mapping: message too large, unknown topic or partition, invalid topic,
/// record refused by the broker: permanent. Everything else (broker down,
/// delivery timeout, full queue): retryable.
pub struct KafkaPublisher {
    producer: Mutex<FutureProducer>,
    client: ClientConfig,
    routing: Topics,
    queue_timeout: Duration,
    envelope: Envelope,
}

// Not derived: the producer has no `Debug`, and the client configuration holds the
// SASL password. The rest is shown, as the other publishers show theirs; the fields
// are destructured so that a new one is shown or hidden on purpose.
impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            producer: _,
            client: _,
            routing,
            queue_timeout,
            envelope,
        } = self;
        f.debug_struct("KafkaPublisher")
            .field("routing", routing)
            .field("queue_timeout", queue_timeout)
            .field("envelope", envelope)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    pub(crate) fn new(config: KafkaConfig) -> Result<Self> {
        let client = config.client_config()?;
        let producer: FutureProducer = client.create()?;
        Ok(Self {
            producer: Mutex::new(producer),
            client,
            routing: config.routing.compile(),
            queue_timeout: config.queue_timeout,
            envelope: config.envelope,
        })
    }

    /// The producer in use (a cheap handle), e.g. to flush it at shutdown.
    pub fn producer(&self) -> FutureProducer {
        match self.producer.lock() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The topic `event` is routed to, or why it cannot be routed.
    pub fn topic_for(&self, event: &Event) -> Result<String, PublishError> {
        self.routing.topic(event).map(|t| t.into_owned())
    }

    /// Wait up to `timeout` for every queued message to be delivered.
    pub async fn flush(&self, timeout: Duration) -> Result<()> {
        let producer = self.producer();
        match tokio::task::spawn_blocking(move || producer.flush(timeout)).await {
            Ok(flushed) => Ok(flushed?),
            // A panic while flushing is a panic of this call.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: the flush did not run to its end.
            Err(_) => Err(Error::Client(KafkaError::Canceled)),
        }
    }

    /// An idempotent producer that hit a fatal error (e.g. a broken sequence) refuses
    /// everything until recreated; do so, so the events retried later can succeed.
    fn recreate_if_fatal(&self, producer: &FutureProducer) {
        let Some((code, reason)) = producer.client().fatal_error() else {
            return;
        };
        tracing::error!(?code, %reason, "kafka producer hit a fatal error; recreating it");
        match self.client.create::<FutureProducer>() {
            Ok(fresh) => match self.producer.lock() {
                Ok(mut p) => *p = fresh,
                Err(poisoned) => *poisoned.into_inner() = fresh,
            },
            Err(error) => tracing::error!(%error, "cannot recreate the kafka producer"),
        }
    }

    /// Queue one message, waiting while the local queue is full, at most until `deadline`.
    async fn enqueue(
        &self,
        producer: &FutureProducer,
        event: &Event,
        deadline: Instant,
    ) -> Result<DeliveryFuture, Outcome> {
        let topic = self.routing.topic(event).map_err(Outcome::Failed)?;
        let encoded = self.envelope.encode(event, &crate::headers::BINDING);
        let mut record = FutureRecord::to(&topic)
            .key(event.aggregate_id.as_bytes())
            .payload(encoded.body.as_ref())
            .headers(envelope::headers(&encoded));
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < deadline =>
                {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((error, _)) => return Err(outcome(&error, &topic)),
            }
        }
    }
}

impl KafkaPublisher {
    /// Queue `events` in order (order within a partition is queue order) and await
    /// every delivery report. With `stop_at_failure`, a message that cannot be queued
    /// ends the queueing: the outcomes stop at its failure, nothing after it is sent.
    async fn deliver(&self, events: &[Event], stop_at_failure: bool) -> Vec<Outcome> {
        let producer = self.producer();
        let deadline = Instant::now() + self.queue_timeout;
        let mut queued = Vec::with_capacity(events.len());
        for event in events {
            let delivery = self.enqueue(&producer, event, deadline).await;
            let failed = delivery.is_err();
            queued.push((delivery, event));
            if failed && stop_at_failure {
                break;
            }
        }
        let outcomes = futures_util::future::join_all(queued.into_iter().map(|(queued, event)| async move {
            match queued {
                Err(outcome) => outcome,
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => Outcome::Published,
                    Ok(Err((error, message))) => {
                        outcome(&error, rdkafka::message::Message::topic(&message))
                    }
                    Err(_canceled) => {
                        tracing::warn!(event_id = %event.id, "kafka producer dropped the message");
                        Outcome::retryable("kafka: producer closed before the delivery report")
                    }
                },
            }
        }))
        .await;
        if outcomes.iter().any(|o| matches!(o, Outcome::Failed(_))) {
            self.recreate_if_fatal(&producer);
        }
        outcomes
    }
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.deliver(events, false).await
    }

    fn run_order(&self) -> RunOrder {
        RunOrder::Pipelined
    }

    /// The whole run in flight at once, in order: one key, hence one partition, where
    /// the idempotent producer (sequence numbers checked by the broker, at most 5
    /// requests in flight, `enable.gapless.guarantee`) writes a message only after
    /// every earlier one of the producer: when message `k` fails, nothing after it
    /// was written, or the producer stops with a fatal error and is recreated.
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        RunOutcome::from_outcomes(self.deliver(run, true).await)
    }

    async fn check(&self) -> Result<(), PublishError> {
        let producer = self.producer();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, CHECK_TIMEOUT)
                .map(|m| m.brokers().len())
        })
        .await;
        match metadata {
            Ok(Ok(brokers)) if brokers > 0 => Ok(()),
            Ok(Ok(_)) => Err(PublishError::unavailable(
                "kafka: the cluster reports no brokers",
            )),
            Ok(Err(error)) => Err(PublishError::unavailable(format!("kafka: {error}"))),
            Err(error) => Err(PublishError::unavailable(format!(
                "kafka: metadata check failed: {error}"
            ))),
        }
    }
}

/// Map a librdkafka error to the event's outcome: permanent when the same message
/// will be refused again, unavailable when the cluster as a whole failed, retryable
/// otherwise.
fn outcome(error: &KafkaError, topic: &str) -> Outcome {
    use RDKafkaErrorCode as C;
    let permanent = matches!(
        error.rdkafka_error_code(),
        Some(
            C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::MessageBatchTooLarge
                | C::UnknownTopicOrPartition
                | C::UnknownTopic
                | C::UnknownPartition
                | C::InvalidTopic
                | C::InvalidRecord
                | C::PolicyViolation
        )
    );
    // The cluster as a whole: no broker reachable, the message expired in the local
    // queue (`message.timeout.ms`) because none took it, or the login was refused.
    let unavailable = matches!(
        error.rdkafka_error_code(),
        Some(
            C::AllBrokersDown
                | C::BrokerTransportFailure
                | C::Resolve
                | C::MessageTimedOut
                | C::BrokerNotAvailable
                | C::NetworkException
                | C::Authentication
                | C::SaslAuthenticationFailed
                | C::SSL
        )
    );
    let message = format!("kafka topic {topic}: {error}");
    if permanent {
        Outcome::permanent(message)
    } else if unavailable {
        Outcome::unavailable(message)
    } else {
        Outcome::retryable(message)
    }
}
