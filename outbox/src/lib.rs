#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use pgoutbox_core::*;

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
