#![doc = include_str!("../README.md")]

mod config;
mod consumer;
mod error;
pub mod headers;
mod publisher;
mod routing;
mod tls;

pub use config::{
    AmqpConfig, AmqpSettings, DEFAULT_URL, ENV_CONNECTION_NAME, ENV_EXCHANGE, ENV_PASSWORD_FILE,
    ENV_TIMEOUT_MS, ENV_TLS_CA, ENV_URL,
};
pub use consumer::metadata;
pub use error::{Error, Result};
/// The envelope settings (outbox or CloudEvents), and the metadata of a received
/// message in any envelope: one type for every adapter.
pub use pgoutbox_core::envelope::{CloudEvents, Envelope, Metadata};
/// Lays the environment over a `*Settings` (`with_env`, `with_vars`).
pub use pgoutbox_core::settings::EnvOverrides;
pub use publisher::AmqpPublisher;
pub use routing::{validate_exchange, AmqpRouting, Route, MAX_SHORT_STRING};

/// The `lapin` crate this one is built on, for matching types.
pub use lapin;
