#![doc = include_str!("../README.md")]

mod config;
mod envelope;
mod error;
pub mod headers;
mod publisher;
mod routing;

/// The AWS SQS SDK this crate is built on, for consumers.
pub use aws_sdk_sqs;
pub use config::{
    SqsConfig, SqsSettings, DEFAULT_MAX_MESSAGE_BYTES, ENV_ENDPOINT, ENV_QUEUE, ENV_QUEUE_PREFIX,
    ENV_REGION, ENV_TIMEOUT_MS,
};
pub use envelope::{event_id, metadata, metadata_from_attributes};
pub use error::{Error, Result};
/// The envelope settings (outbox or CloudEvents), and the metadata of a received
/// message in any envelope: one type for every adapter.
pub use pgoutbox_core::envelope::{CloudEvents, Envelope, Metadata};
/// Lays the environment over a `*Settings` (`with_env`, `with_vars`).
pub use pgoutbox_core::settings::EnvOverrides;
pub use publisher::SqsPublisher;
