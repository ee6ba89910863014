//! Errors of the NATS publisher: configuration, connection, stream administration
//! and reading events back from messages.

use pgoutbox_core::settings::ConfigError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in the NATS publisher or consumer helpers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is invalid (its key and why); nothing was connected.
    #[error("invalid NATS configuration: {0}")]
    Config(#[from] ConfigError),
    /// Connecting to the NATS server failed.
    #[error("cannot connect to NATS at {url}: {reason}")]
    Connect {
        /// The server URL(s).
        url: String,
        /// What the client said.
        reason: String,
    },
    /// A JetStream administration call (stream or consumer) failed.
    #[error("JetStream {operation} failed: {reason}")]
    JetStream {
        /// What was attempted, e.g. `create stream ORDERS`.
        operation: String,
        /// What the server or client said.
        reason: String,
    },
    /// A received message lacks the outbox metadata or carries invalid values.
    #[error("message on `{subject}` is not an outbox event: {reason}")]
    NotAnEvent {
        /// The message's subject.
        subject: String,
        /// What is missing or invalid.
        reason: String,
    },
}

impl Error {
    /// True if the same call may succeed later (connection and server errors);
    /// false for invalid configuration or messages.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Connect { .. } | Self::JetStream { .. })
    }

    pub(crate) fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config(ConfigError::new(key, reason))
    }

    pub(crate) fn jetstream(operation: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::JetStream {
            operation: operation.into(),
            reason: reason.to_string(),
        }
    }
}
