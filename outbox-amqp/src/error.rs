//! Errors of the AMQP publisher: configuration, connection, topology, reading events back.

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in the AMQP publisher or consumer helpers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid; nothing was connected.
    #[error("invalid AMQP outbox configuration: {field}: {reason}")]
    Config {
        /// The setting (or environment variable) at fault.
        field: String,
        /// Why it was refused.
        reason: String,
    },
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

    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// A variable laid over the settings that cannot be read: the variable is the field.
impl From<pgoutbox_core::settings::VarError> for Error {
    fn from(e: pgoutbox_core::settings::VarError) -> Self {
        Self::config(e.var, format!("`{}`: {}", e.value, e.reason))
    }
}
