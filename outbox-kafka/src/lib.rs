#![doc = include_str!("../README.md")]

mod admin;
mod config;
mod envelope;
mod error;
pub mod headers;
mod publisher;
mod routing;

pub use config::{
    KafkaConfig, KafkaSettings, ENV_BROKERS, ENV_DELIVERY_TIMEOUT_MS, ENV_QUEUE_TIMEOUT_MS,
    ENV_RDKAFKA_PREFIX, ENV_SASL_PASSWORD_FILE, ENV_TOPIC, ENV_TOPIC_PREFIX,
};
pub use envelope::{event_id, metadata};
pub use error::{Error, Result};
/// The envelope settings (outbox or CloudEvents), and the metadata of a received
/// message in any envelope: one type for every adapter.
pub use pgoutbox_core::envelope::{CloudEvents, Envelope, Metadata};
/// Lays the environment over a `*Settings` (`with_env`, `with_vars`).
pub use pgoutbox_core::settings::EnvOverrides;
pub use publisher::KafkaPublisher;
/// The rdkafka crate this one is built on, for consumers and the mock cluster.
pub use rdkafka;
