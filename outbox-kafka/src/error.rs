//! The crate's error type.

use pgoutbox_core::settings::ConfigError;
use rdkafka::error::KafkaError;

/// A `Result` with this crate's [`Error`] as default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong while configuring the Kafka publisher or reading a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting (a key or an environment variable) is invalid: its key and why.
    #[error("invalid Kafka configuration: {0}")]
    Config(#[from] ConfigError),
    /// A topic name is not a valid Kafka topic name.
    #[error("invalid kafka topic {topic:?}: {reason}")]
    InvalidTopic {
        /// The topic name.
        topic: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// librdkafka refused the client configuration or could not create the client.
    #[error("kafka client: {0}")]
    Client(#[from] KafkaError),
    /// A received message lacks an outbox header.
    #[error("kafka message has no {name} header: not published by the outbox")]
    MissingHeader {
        /// The header name.
        name: &'static str,
    },
    /// A topic could not be created, or did not become usable in time.
    #[error("kafka topic {topic}: {reason}")]
    TopicNotCreated {
        /// The topic.
        topic: String,
        /// What the broker said, or what did not happen in time.
        reason: String,
    },
    /// A topic could not be deleted.
    #[error("kafka topic {topic}: cannot delete it: {reason}")]
    TopicNotDeleted {
        /// The topic.
        topic: String,
        /// What the broker said.
        reason: String,
    },
    /// A received message has an outbox header that cannot be read.
    #[error("kafka message header {name} is invalid: {reason}")]
    InvalidHeader {
        /// The header name.
        name: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// A received message is a CloudEvent the outbox cannot read (an attribute the
    /// outbox sends is missing or malformed).
    #[error("kafka message: {0}")]
    CloudEvent(pgoutbox_core::envelope::EnvelopeError),
}

impl Error {
    /// True if doing the same thing again later may succeed (a client error of
    /// librdkafka that it marks retriable); configuration and message errors are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Client(e) => e
                .rdkafka_error_code()
                .is_some_and(|c| !matches!(c, rdkafka::types::RDKafkaErrorCode::Fatal)),
            _ => false,
        }
    }
}
