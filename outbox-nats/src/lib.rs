#![doc = include_str!("../README.md")]

mod config;
mod consumer;
mod error;
pub mod headers;
mod publisher;
mod routing;
#[cfg(feature = "test-utils")]
pub mod testing;
mod tls;

pub use config::{
    NatsConfig, NatsSettings, DEFAULT_URL, ENV_CLIENT_NAME, ENV_CREDS, ENV_MAX_IN_FLIGHT,
    ENV_NKEY_FILE, ENV_PASSWORD, ENV_PASSWORD_FILE, ENV_SUBJECT_PREFIX, ENV_TIMEOUT_MS, ENV_TLS_CA,
    ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_REQUIRED, ENV_TOKEN, ENV_TOKEN_FILE, ENV_URL, ENV_USER,
};
pub use consumer::{metadata, EventConsumer, EventMessage};
pub use error::{Error, Result};
/// The envelope settings (outbox or CloudEvents), and the metadata of a received
/// message in any envelope: one type for every adapter.
pub use pgoutbox_core::envelope::{CloudEvents, Envelope, Metadata};
/// Lays the environment over a `*Settings` (`with_env`, `with_vars`).
pub use pgoutbox_core::settings::EnvOverrides;
pub use publisher::{NatsPublisher, DEFAULT_DUPLICATE_WINDOW};
pub use routing::{validate_subject, SubjectRouting};

/// The `async-nats` crate this one is built on, for matching types.
pub use async_nats;
