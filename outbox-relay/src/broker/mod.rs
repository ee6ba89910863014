//! The broker the relay publishes to, chosen by `broker.kind` / `OUTBOX_BROKER`.
//!
//! Every broker, built in or added with [`App::broker`](crate::App::broker), is a
//! [`BrokerFactory`] registered under its kind: the built-in ones in [`built_in`],
//! one line each. A factory is given its `[broker.<kind>]` section with the
//! `[routing]` rules and the `[envelope]` ([`BrokerInput`]); it checks them before
//! anything starts and builds the publisher when the relay (or `outbox check`) needs
//! it. The built-in adapters lay their `OUTBOX_<BROKER>_*` variables over the
//! section (the environment wins over the file, as everywhere else).
//!
//! Adding a broker to the binary: docs/design.md, "Adding a broker".

#[cfg(feature = "amqp")]
mod amqp;
mod input;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "sqs")]
mod sqs;
mod stdout;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use pgoutbox_core::layer::{MetricsLayer, PublisherExt};
use pgoutbox_core::{DynPublisher, Publisher};

use crate::config::Settings;
use crate::failure::Failure;

pub use input::BrokerInput;

/// An error a [`BrokerFactory`] returns: anything, shown in the binary's one-line message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What [`BrokerFactory::build`] returns.
pub type BuildFuture =
    Pin<Box<dyn Future<Output = Result<Arc<dyn DynPublisher>, BrokerError>> + Send>>;

/// Why a [`BrokerFactory`] could not build its publisher.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The settings are wrong: the binary exits with its configuration code (2).
    #[error("{0}")]
    Invalid(BoxError),
    /// The broker refused or did not answer while preparing what the settings
    /// name (a stream, topics): the binary exits with its run-time code (1).
    #[error("{0}")]
    Unavailable(BoxError),
}

/// Builds the publisher of one broker kind from its [`BrokerInput`]: the built-in
/// brokers and those added with [`App::broker`](crate::App::broker) alike.
///
/// Implemented by every `Fn(toml::Table) -> impl Future<Output = Result<P, BoxError>>`
/// where `P` is a [`Publisher`], so a closure or an `async fn` given the
/// `[broker.<kind>]` table is a factory.
pub trait BrokerFactory: Send + Sync {
    /// Check the settings without connecting. Called once, before the runtime
    /// starts, by the commands that publish (`relay`, `check`): an error here is a
    /// configuration error. The default accepts anything.
    fn check(&self, input: &BrokerInput) -> Result<(), BoxError> {
        let _ = input;
        Ok(())
    }

    /// Build the publisher. Connect lazily if you can: the relay should start while
    /// its broker is down (`/readyz` tells when it is reachable).
    fn build(&self, input: BrokerInput) -> BuildFuture;
}

impl<F, Fut, P> BrokerFactory for F
where
    F: Fn(toml::Table) -> Fut + Send + Sync,
    Fut: Future<Output = Result<P, BoxError>> + Send + 'static,
    P: Publisher + 'static,
{
    fn build(&self, input: BrokerInput) -> BuildFuture {
        let publisher = self(input.into_section());
        Box::pin(async move {
            let publisher: Arc<dyn DynPublisher> =
                Arc::new(publisher.await.map_err(BrokerError::Invalid)?);
            Ok(publisher)
        })
    }
}

/// The broker kinds of this binary in registration order (the built-in ones first),
/// each with its factory, or `None` for a built-in one it was compiled without.
pub(crate) struct Brokers {
    kinds: Vec<(String, Option<Arc<dyn BrokerFactory>>)>,
}

/// A built-in broker's registration: its kind, and its factory when its feature
/// is compiled in (`None` when not: its kind is still known, for the error).
macro_rules! built_in_broker {
    ($kind:literal, $factory:expr) => {{
        #[cfg(feature = $kind)]
        let factory: Option<Arc<dyn BrokerFactory>> = Some(Arc::new($factory));
        #[cfg(not(feature = $kind))]
        let factory: Option<Arc<dyn BrokerFactory>> = None;
        ($kind, factory)
    }};
}

/// The built-in brokers. A broker's line here, its module above and its feature in
/// Cargo.toml are all the binary knows of it.
fn built_in() -> Vec<(&'static str, Option<Arc<dyn BrokerFactory>>)> {
    vec![
        ("stdout", Some(Arc::new(stdout::Stdout))),
        built_in_broker!("nats", nats::Nats),
        built_in_broker!("amqp", amqp::Amqp),
        built_in_broker!("kafka", kafka::Kafka),
        built_in_broker!("sqs", sqs::Sqs),
    ]
}

impl Default for Brokers {
    fn default() -> Self {
        let kinds = built_in()
            .into_iter()
            .map(|(kind, factory)| (kind.to_string(), factory))
            .collect();
        Self { kinds }
    }
}

impl Brokers {
    /// Whether `kind` is taken: a broker of this binary, or a built-in one it was
    /// compiled without.
    pub(crate) fn is_known(&self, kind: &str) -> bool {
        self.kinds.iter().any(|(known, _)| known == kind)
    }

    /// Add a broker of the program's own. The caller checked that `kind` is new.
    pub(crate) fn add(&mut self, kind: &str, factory: Arc<dyn BrokerFactory>) {
        self.kinds.push((kind.to_string(), Some(factory)));
    }

    /// The factory of `kind`: `Err(true)` when it is a built-in broker this binary
    /// was compiled without, `Err(false)` when unknown.
    fn factory(&self, kind: &str) -> Result<&Arc<dyn BrokerFactory>, bool> {
        match self.kinds.iter().find(|(known, _)| known == kind) {
            Some((_, Some(factory))) => Ok(factory),
            Some((_, None)) => Err(true),
            None => Err(false),
        }
    }

    /// The broker kinds of this binary.
    fn names(&self) -> Vec<&str> {
        self.kinds
            .iter()
            .filter(|(_, factory)| factory.is_some())
            .map(|(kind, _)| kind.as_str())
            .collect()
    }

    /// Every key of `[broker]` besides `kind` must be the section of a broker of
    /// this binary (or of a built-in one it was compiled without): a misspelt key
    /// or section is an error.
    pub(crate) fn check_sections(&self, settings: &Settings) -> Result<(), Failure> {
        for (key, value) in &settings.broker.sections {
            match (self.is_known(key), value.is_table()) {
                (true, true) => {}
                (true, false) => {
                    return Err(Failure::config(format!(
                        "broker.{key} must be a section ([broker.{key}])"
                    )))
                }
                (false, true) => {
                    return Err(Failure::config(format!(
                        "unknown broker section [broker.{key}] (brokers of this binary: {})",
                        self.names().join(", ")
                    )))
                }
                (false, false) => {
                    return Err(Failure::config(format!(
                        "unknown key broker.{key} (expected kind or a [broker.<kind>] section)"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// Whether building a publisher also creates what the configuration asks for
/// (a JetStream stream, Kafka topics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prepare {
    Yes,
    No,
}

/// A broker configuration read and checked, not connected yet.
pub(crate) struct Spec {
    factory: Arc<dyn BrokerFactory>,
    input: BrokerInput,
}

/// The publisher of whichever broker is configured, behind the object-safe
/// [`DynPublisher`]: the relay, `/readyz` and any publisher a user builds take the
/// same path.
pub(crate) type BrokerPublisher = Arc<dyn DynPublisher>;

impl Spec {
    /// Read the broker's configuration and let its factory check it.
    pub(crate) fn read(settings: &Settings, brokers: &Brokers) -> Result<Self, Failure> {
        let kind = settings.broker.kind.trim();
        let factory = match brokers.factory(kind) {
            Ok(factory) => factory,
            Err(true) => {
                return Err(Failure::config(format!(
                    "broker `{kind}` is not compiled into this binary (brokers built in: {}); \
                     rebuild with `cargo build -p pgoutbox-relay --features {kind}`",
                    brokers.names().join(", ")
                )))
            }
            Err(false) => {
                let known: Vec<&str> = brokers.kinds.iter().map(|(k, _)| k.as_str()).collect();
                return Err(Failure::config(format!(
                    "unknown broker `{kind}` (broker.kind or OUTBOX_BROKER): expected one of {}",
                    known.join(", ")
                )));
            }
        };
        let input = BrokerInput::new(kind, settings);
        factory
            .check(&input)
            .map_err(|e| Failure::config(format!("broker {kind}: {e}")))?;
        input.warn_unused();
        Ok(Self {
            factory: Arc::clone(factory),
            input,
        })
    }

    /// The broker's name, for logs.
    pub(crate) fn name(&self) -> &str {
        self.input.kind()
    }

    /// Create the publisher. Adapters connect lazily, so a relay can start while its
    /// broker is down; `/readyz` tells when it is reachable. With `Prepare::Yes`
    /// the configured JetStream stream and Kafka topics are created when missing
    /// (`outbox check` leaves them alone). The publisher reports its calls as
    /// `outbox_publisher_*` metrics labelled with the broker's name ([`MetricsLayer`]).
    pub(crate) async fn build(self, prepare: Prepare) -> Result<BrokerPublisher, Failure> {
        let kind = self.input.kind().to_string();
        let input = self.input.create_missing(prepare == Prepare::Yes);
        let publisher = self.factory.build(input).await.map_err(|e| match e {
            BrokerError::Invalid(e) => Failure::config(format!("broker {kind}: {e}")),
            BrokerError::Unavailable(e) => Failure::runtime(format!("broker {kind}: {e}")),
        })?;
        let metrics = MetricsLayer::new(&kind);
        Ok(Arc::new(publisher.layer(metrics)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_text;

    #[cfg(all(feature = "kafka", feature = "nats"))]
    #[test]
    fn a_broker_section_is_the_adapters_settings_type() {
        let settings = from_text(
            "[broker.kafka]\ncreate_topics_with_partitions = 3\ndelivery_timeout = \"7s\"\n\
             [broker.kafka.properties]\n\"linger.ms\" = \"5\"\n",
        )
        .unwrap();
        let kafka: pgoutbox_kafka::KafkaSettings =
            BrokerInput::new("kafka", &settings).parse().unwrap();
        assert_eq!(kafka.create_topics_with_partitions, Some(3));
        assert_eq!(
            kafka.delivery_timeout,
            Some(pgoutbox_core::settings::HumanDuration::secs(7))
        );
        assert_eq!(kafka.properties["linger.ms"], "5");

        // A mistake in the chosen broker's section names the file's line.
        let brokers = Brokers::default();
        let settings = from_text("[broker]\nkind = \"nats\"\n[broker.nats]\nurll = \"nats://x\"\n");
        let err = Spec::read(&settings.unwrap(), &brokers)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("urll") && err.contains("line 4"), "{err}");
        let settings = from_text("[broker.nats]\nurll = \"nats://x\"\n").unwrap();
        let err = BrokerInput::new("nats", &settings)
            .parse::<pgoutbox_nats::NatsSettings>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("urll") && err.contains("line 2"), "{err}");
        let settings = from_text("[broker.nats]\ntimeout = \"soon\"\n").unwrap();
        let err = BrokerInput::new("nats", &settings)
            .parse::<pgoutbox_nats::NatsSettings>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("soon") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn every_built_in_broker_is_registered_or_known_as_not_compiled() {
        let brokers = Brokers::default();
        for kind in ["stdout", "nats", "amqp", "kafka", "sqs"] {
            assert!(brokers.is_known(kind), "{kind}");
        }
        assert!(!brokers.is_known("audit-log"));
        assert_eq!(brokers.factory("nats").is_ok(), cfg!(feature = "nats"));
    }

    #[test]
    fn a_section_of_an_unknown_broker_is_refused() {
        let settings = from_text("[broker.natss]\nurl = \"nats://x\"\n").unwrap();
        let err = Brokers::default().check_sections(&settings).unwrap_err();
        assert!(err.to_string().contains("[broker.natss]"), "{err}");
        let settings = from_text("[broker]\nkind = \"stdout\"\nnats = 1\n").unwrap();
        let err = Brokers::default().check_sections(&settings).unwrap_err();
        assert!(
            err.to_string().contains("broker.nats must be a section"),
            "{err}"
        );
    }
}
