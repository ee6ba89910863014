#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use outbox_core::*;

/// PostgreSQL storage: enqueue, relay store, dead letters, cleanup, inbox.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use outbox_postgres as postgres;

/// Kafka publisher.
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use outbox_kafka as kafka;

/// RabbitMQ / AMQP 0.9.1 publisher.
#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use outbox_amqp as amqp;

/// Amazon SQS publisher.
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub use outbox_sqs as sqs;

/// NATS JetStream publisher.
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use outbox_nats as nats;
