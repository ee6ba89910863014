//! Errors of the AMQP publisher: configuration, connection, topology, reading events back.

use pgoutbox_core::settings::ConfigError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in the AMQP publisher or consumer helpers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is invalid (its key and why); nothing was connected.
    #[error("invalid AMQP configuration: {0}")]
    Config(#[from] ConfigError),
    /// Connecting, opening a channel or enabling publisher confirms failed.
    #[error("cannot connect to AMQP broker at {url}: {reason}")]
    Connect {
        /// The broker URL, without password.
        url: String,
        /// What the client said.
        reason: String,
    },
    /// Declaring an exchange or queue failed.
    #[error("AMQP {operation} failed: {source}")]
    Topology {
        /// What was attempted.
        operation: String,
        /// The client error.
        #[source]
        source: lapin::Error,
    },
    /// A delivery lacks the outbox metadata or carries invalid values.
    #[error("delivery from exchange `{exchange}` is not an outbox event: {reason}")]
    NotAnEvent {
        /// The exchange it was published to.
        exchange: String,
        /// What is missing or invalid.
        reason: String,
    },
}

impl Error {
    /// True if the same call may succeed later (connection and broker errors).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Connect { .. } | Self::Topology { .. })
    }

    pub(crate) fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config(ConfigError::new(key, reason))
    }
}
