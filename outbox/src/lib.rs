#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The core's API by name (not `*`): its helpers for writing adapters (the
// settings and routing macros) stay in `pgoutbox-core`.
pub use pgoutbox_core::{
    admin, envelope, event, layer, local, publisher, relay, retry, routing, settings, store,
    telemetry, uuid,
};
pub use pgoutbox_core::{
    read_secret_file, redact_url, BatchReport, BrokerHealth, BrokerStatus, ChannelPublisher, Claim,
    DeadLetter, DeadLetterAdmin, DeadLetterFilter, Decision, DecodeError, DynPublisher, Event,
    EventError, FailureKind, Headers, Liveness, NewEvent, NullPublisher, OutboxStats, Outcome,
    PublishError, Publisher, Relay, RelayConfig, RelayStats, RelayStatsSnapshot, RetentionAdmin,
    RetryPolicy, Routing, RunOrder, RunOutcome, SecretFileError, StatsAdmin, StdoutPublisher,
    Store, StoreError, TypedEvent, TRACEPARENT,
};

/// In-memory store and recording publisher for tests.
#[cfg(feature = "test-utils")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-utils")))]
pub use pgoutbox_core::testing;

/// OpenTelemetry trace context from producer through relay to consumer.
#[cfg(feature = "opentelemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
pub use pgoutbox_core::trace_context;

/// PostgreSQL storage: enqueue, relay store, dead letters, cleanup, inbox.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use pgoutbox_postgres as postgres;

/// Kafka publisher.
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use pgoutbox_kafka as kafka;

/// RabbitMQ / AMQP 0.9.1 publisher.
#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use pgoutbox_amqp as amqp;

/// Amazon SQS publisher.
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub use pgoutbox_sqs as sqs;

/// NATS JetStream publisher.
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use pgoutbox_nats as nats;
