//! The crate's error type.

/// A `Result` with this crate's [`Error`] as default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong while configuring the SQS publisher or reading a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An environment variable has a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// A configuration value is invalid.
    #[error("sqs config: {field}: {reason}")]
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// No AWS region was found.
    #[error("sqs config: no AWS region; set AWS_REGION, OUTBOX_SQS_REGION or SqsConfig::region")]
    MissingRegion,
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
    /// An envelope setting is invalid.
    #[error("SQS envelope: {0}")]
    Envelope(#[from] pgoutbox_core::envelope::EnvelopeConfigError),
}

impl Error {
    /// True if doing the same thing again later may succeed; none of these errors do.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

impl From<pgoutbox_core::settings::VarError> for Error {
    fn from(e: pgoutbox_core::settings::VarError) -> Self {
        Self::InvalidEnv {
            var: e.var,
            value: e.value,
            reason: e.reason,
        }
    }
}
