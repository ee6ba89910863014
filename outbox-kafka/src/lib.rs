#![doc = include_str!("../README.md")]

mod admin;
mod config;
mod envelope;
mod error;
mod publisher;
mod routing;

pub use config::{
    KafkaConfig, ENV_BROKERS, ENV_DELIVERY_TIMEOUT_MS, ENV_QUEUE_TIMEOUT_MS, ENV_RDKAFKA_PREFIX,
    ENV_SASL_PASSWORD_FILE, ENV_TOPIC, ENV_TOPIC_PREFIX,
};
pub use envelope::{
    event_id, metadata, HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE, HEADER_CREATED_AT,
    HEADER_EVENT_ID, HEADER_EVENT_TYPE, RESERVED_HEADERS,
};
pub use error::{Error, Result};
/// The outbox metadata of a received message: one type for every adapter.
pub use pgoutbox_core::envelope::Metadata;
pub use publisher::KafkaPublisher;
/// The rdkafka crate this one is built on, for consumers and the mock cluster.
pub use rdkafka;
