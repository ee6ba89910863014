//! The crate's error type.

use pgoutbox_core::settings::ConfigError;

/// A `Result` with this crate's [`Error`] as default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong while configuring the SQS publisher or reading a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting (a key, an environment variable or the envelope) is invalid, or
    /// no AWS region was found (key `region`): its key and why.
    #[error("invalid SQS configuration: {0}")]
    Config(#[from] ConfigError),
    /// A queue name or URL is not valid.
    #[error("invalid SQS queue {queue:?}: {reason}")]
    InvalidQueue {
        /// The queue name or URL.
        queue: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A received message lacks an outbox attribute.
    #[error("SQS message has no {name} attribute (receive with message_attribute_names(\"All\")): not published by the outbox?")]
    MissingAttribute {
        /// The attribute name.
        name: &'static str,
    },
    /// A received message has an outbox attribute that cannot be read.
    #[error("SQS message attribute {name} is invalid: {reason}")]
    InvalidAttribute {
        /// The attribute name.
        name: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// A received message is a CloudEvent the outbox cannot read (an attribute the
    /// outbox sends is missing or malformed).
    #[error("SQS message: {0}")]
    CloudEvent(pgoutbox_core::envelope::EnvelopeError),
}

impl Error {
    /// True if doing the same thing again later may succeed; none of these errors do.
    pub fn is_retryable(&self) -> bool {
        false
    }
}
