#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
mod broker_health;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
pub mod envelope;
pub mod event;
pub mod layer;
mod liveness;
pub mod local;
pub mod publisher;
pub mod relay;
pub mod retry;
pub mod routing;
mod secret;
pub mod settings;
pub mod store;
pub mod telemetry;
#[cfg(feature = "test-utils")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-utils")))]
pub mod testing;
#[cfg(feature = "opentelemetry")]
pub mod trace_context;
mod waves;

pub use admin::{
    DeadLetter, DeadLetterAdmin, DeadLetterFilter, OutboxStats, RetentionAdmin, StatsAdmin,
};
pub use broker_health::{BrokerHealth, BrokerStatus};
pub use envelope::DecodeError;
pub use event::{Event, EventError, Headers, NewEvent, TypedEvent, TRACEPARENT};
pub use liveness::Liveness;
pub use local::{ChannelPublisher, NullPublisher, StdoutPublisher};
pub use publisher::{
    DynPublisher, FailureKind, Outcome, PublishError, Publisher, RunOrder, RunOutcome,
};
pub use relay::{BatchReport, Relay, RelayConfig, RelayStats, RelayStatsSnapshot};
pub use retry::RetryPolicy;
pub use routing::Routing;
pub use secret::{read_secret_file, redact_url, SecretFileError};
pub use store::{Claim, Decision, Store, StoreError};
/// The `uuid` crate of [`Event::id`] and [`NewEvent::with_id`], so users name the same version.
pub use uuid;
