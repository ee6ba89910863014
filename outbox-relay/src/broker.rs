//! The broker the relay publishes to, chosen by `broker.kind` / `OUTBOX_BROKER`.
//!
//! The `[broker.<kind>]` section is the adapter's own settings type; the adapter
//! lays its `OUTBOX_<BROKER>_*` variables over it (`with_env`: the environment wins
//! over the file, as everywhere else) and builds its typed config from the result
//! (`from_settings`). Routing rules come from `[routing]`.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::layer::{MetricsLayer, PublisherExt};
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs"))]
use pgoutbox_core::settings::EnvOverrides;
use pgoutbox_core::{DynPublisher, Publisher, StdoutPublisher};

use crate::config::{BrokerSection, RoutingSection, Settings};
use crate::failure::Failure;

/// Every broker name, compiled in or not.
const KNOWN: &[&str] = &["stdout", "nats", "amqp", "kafka", "sqs"];

/// An error a [`BrokerFactory`] returns: anything, shown in the binary's one-line message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What [`BrokerFactory::build`] returns.
pub type BuildFuture =
    Pin<Box<dyn Future<Output = Result<Arc<dyn DynPublisher>, BoxError>> + Send>>;

/// Builds the publisher of a broker added to the binary with
/// [`App::broker`](crate::App::broker), from its `[broker.<kind>]` section.
///
/// Implemented by every `Fn(toml::Table) -> impl Future<Output = Result<P, BoxError>>`
/// where `P` is a [`Publisher`], so a closure or an `async fn` is a factory.
pub trait BrokerFactory: Send + Sync {
    /// Build the publisher. `section` is the `[broker.<kind>]` table of the
    /// configuration file (empty when the file has none); deserialise it with
    /// `section.try_into::<YourConfig>()`. Connect lazily if you can: the relay
    /// should start while its broker is down (`/readyz` tells when it is reachable).
    fn build(&self, section: toml::Table) -> BuildFuture;
}

impl<F, Fut, P> BrokerFactory for F
where
    F: Fn(toml::Table) -> Fut + Send + Sync,
    Fut: Future<Output = Result<P, BoxError>> + Send + 'static,
    P: Publisher + 'static,
{
    fn build(&self, section: toml::Table) -> BuildFuture {
        let publisher = self(section);
        Box::pin(async move {
            let publisher: Arc<dyn DynPublisher> = Arc::new(publisher.await?);
            Ok(publisher)
        })
    }
}

/// Brokers added by a program built on the library, by kind.
pub(crate) type CustomBrokers = BTreeMap<String, Arc<dyn BrokerFactory>>;

/// Whether `kind` is the name of a built-in broker (compiled in or not).
pub(crate) fn is_built_in(kind: &str) -> bool {
    KNOWN.contains(&kind)
}

/// Every key of `[broker]` the file has besides the built-in ones must be the
/// section of a custom broker: a misspelt key or section is an error.
pub(crate) fn check_sections(settings: &Settings, custom: &CustomBrokers) -> Result<(), Failure> {
    for (key, value) in &settings.broker.custom {
        // A built-in broker's section in a binary without it: read only if chosen,
        // and then `Spec::read` says it is not compiled in.
        if is_built_in(key) && value.is_table() {
            continue;
        }
        match (custom.contains_key(key), value.is_table()) {
            (true, true) => {}
            (true, false) => {
                return Err(Failure::config(format!(
                    "broker.{key} must be a section ([broker.{key}])"
                )))
            }
            (false, true) => {
                return Err(Failure::config(format!(
                    "unknown broker section [broker.{key}] (brokers of this binary: {})",
                    names(custom).join(", ")
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

/// The broker names of this binary: built in and compiled, then custom ones.
fn names(custom: &CustomBrokers) -> Vec<&str> {
    let mut names = compiled();
    names.extend(custom.keys().map(String::as_str));
    names
}

/// Whether building a publisher also creates what the configuration asks for
/// (a JetStream stream, Kafka topics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prepare {
    Yes,
    No,
}

/// A broker configuration read and checked, not connected yet.
pub(crate) enum Spec {
    Stdout,
    Custom {
        kind: String,
        section: toml::Table,
        factory: Arc<dyn BrokerFactory>,
    },
    #[cfg(feature = "nats")]
    Nats(pgoutbox_nats::NatsConfig, Option<String>),
    #[cfg(feature = "amqp")]
    Amqp(pgoutbox_amqp::AmqpConfig),
    #[cfg(feature = "kafka")]
    /// The config, and the partitions of topics to create when missing.
    Kafka(pgoutbox_kafka::KafkaConfig, Option<i32>),
    #[cfg(feature = "sqs")]
    Sqs(pgoutbox_sqs::SqsConfig),
}

/// The publisher of whichever broker is configured, behind the object-safe
/// [`DynPublisher`]: the relay, `/readyz` and any publisher a user builds take the
/// same path.
pub(crate) type BrokerPublisher = Arc<dyn DynPublisher>;

/// The broker names compiled into this binary.
pub(crate) fn compiled() -> Vec<&'static str> {
    let mut names = vec!["stdout"];
    if cfg!(feature = "nats") {
        names.push("nats");
    }
    if cfg!(feature = "amqp") {
        names.push("amqp");
    }
    if cfg!(feature = "kafka") {
        names.push("kafka");
    }
    if cfg!(feature = "sqs") {
        names.push("sqs");
    }
    names
}

impl Spec {
    /// Read the broker's configuration: the file's `[broker.<kind>]` section with
    /// the adapter's environment variables laid over it.
    pub(crate) fn read(settings: &Settings, custom: &CustomBrokers) -> Result<Self, Failure> {
        let kind = settings.broker.kind.trim();
        if let Some(factory) = custom.get(kind) {
            if !settings.routing.event_type.is_empty()
                || !settings.routing.aggregate_type.is_empty()
            {
                tracing::warn!(
                    "broker {kind}: [routing] rules are for the built-in brokers; ignored"
                );
            }
            if settings.envelope != Envelope::Outbox {
                tracing::warn!("broker {kind}: [envelope] is for the built-in brokers; ignored");
            }
            let section = match settings.broker.custom.get(kind) {
                Some(toml::Value::Table(table)) => table.clone(),
                _ => toml::Table::new(),
            };
            return Ok(Self::Custom {
                kind: kind.to_string(),
                section,
                factory: Arc::clone(factory),
            });
        }
        if !KNOWN.contains(&kind) {
            let mut expected = KNOWN.to_vec();
            expected.extend(custom.keys().map(String::as_str));
            return Err(Failure::config(format!(
                "unknown broker `{kind}` (broker.kind or OUTBOX_BROKER): expected one of {}",
                expected.join(", ")
            )));
        }
        if !compiled().contains(&kind) {
            return Err(Failure::config(format!(
                "broker `{kind}` is not compiled into this binary (brokers built in: {}); \
                 rebuild with `cargo build -p pgoutbox-relay --features {kind}`",
                compiled().join(", ")
            )));
        }
        if kind == "stdout" && settings.envelope != Envelope::Outbox {
            tracing::warn!("broker stdout: [envelope] is for the message brokers; ignored");
        }
        read_kind(
            kind,
            &settings.broker,
            &settings.routing,
            &settings.envelope,
        )
    }

    /// The broker's name, for logs.
    pub(crate) fn name(&self) -> &str {
        match self {
            Self::Stdout => "stdout",
            Self::Custom { kind, .. } => kind,
            #[cfg(feature = "nats")]
            Self::Nats(..) => "nats",
            #[cfg(feature = "amqp")]
            Self::Amqp(..) => "amqp",
            #[cfg(feature = "kafka")]
            Self::Kafka(..) => "kafka",
            #[cfg(feature = "sqs")]
            Self::Sqs(..) => "sqs",
        }
    }

    /// Create the publisher. Adapters connect lazily, so a relay can start while its
    /// broker is down; `/readyz` tells when it is reachable. With `Prepare::Yes`
    /// the configured JetStream stream and Kafka topics are created when missing
    /// (`outbox check` leaves them alone). The publisher reports its calls as
    /// `outbox_publisher_*` metrics labelled with the broker's name ([`MetricsLayer`]).
    pub(crate) async fn build(self, prepare: Prepare) -> Result<BrokerPublisher, Failure> {
        #[cfg_attr(not(any(feature = "nats", feature = "kafka")), allow(unused_variables))]
        let prepare = prepare == Prepare::Yes;
        let metrics = MetricsLayer::new(self.name());
        let publisher: BrokerPublisher = match self {
            Self::Stdout => Arc::new(StdoutPublisher),
            Self::Custom {
                kind,
                section,
                factory,
            } => factory
                .build(section)
                .await
                .map_err(|e| Failure::config(format!("broker {kind}: {e}")))?,
            #[cfg(feature = "nats")]
            Self::Nats(config, stream) => {
                let publisher = config.build().await.map_err(invalid)?;
                if let (true, Some(name)) = (prepare, stream) {
                    let stream_config = publisher.stream_config(&name);
                    publisher
                        .ensure_stream(stream_config)
                        .await
                        .map_err(|e| Failure::runtime(format!("broker: {e}")))?;
                }
                Arc::new(publisher)
            }
            #[cfg(feature = "amqp")]
            Self::Amqp(config) => Arc::new(config.build().map_err(invalid)?),
            #[cfg(feature = "kafka")]
            Self::Kafka(config, partitions) => {
                if let (true, Some(partitions)) = (prepare, partitions) {
                    for topic in config.named_topics() {
                        config
                            .ensure_topic(&topic, partitions, KAFKA_TOPIC_TIMEOUT)
                            .await
                            .map_err(|e| Failure::runtime(format!("broker: {e}")))?;
                        tracing::info!(%topic, partitions, "kafka topic ready");
                    }
                }
                Arc::new(config.build().map_err(invalid)?)
            }
            #[cfg(feature = "sqs")]
            Self::Sqs(config) => Arc::new(config.build().await.map_err(invalid)?),
        };
        Ok(Arc::new(publisher.layer(metrics)))
    }
}

/// Longest wait for a Kafka topic to be created and get its partition leaders.
#[cfg(feature = "kafka")]
const KAFKA_TOPIC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A broker setting the adapter refused.
#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs")),
    allow(dead_code)
)]
fn invalid(e: impl std::fmt::Display) -> Failure {
    Failure::config(format!("broker: {e}"))
}

#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs")),
    allow(unused_variables)
)]
fn read_kind(
    kind: &str,
    broker: &BrokerSection,
    routing: &RoutingSection,
    envelope: &Envelope,
) -> Result<Spec, Failure> {
    let bad = |e: &dyn std::fmt::Display| Failure::config(format!("broker {kind}: {e}"));
    match kind {
        #[cfg(feature = "nats")]
        "nats" => {
            let settings = broker.nats.clone().with_env().map_err(|e| bad(&e))?;
            let config =
                pgoutbox_nats::NatsConfig::from_settings(&settings).map_err(|e| bad(&e))?;
            let mut rules = pgoutbox_nats::SubjectRouting::new(config.routing.prefix());
            for (event_type, subject) in &routing.event_type {
                rules = rules.event_type(event_type, subject);
            }
            for (aggregate_type, subject) in &routing.aggregate_type {
                rules = rules.aggregate_type(aggregate_type, subject);
            }
            let config = config.routing(rules).envelope(envelope.clone());
            config.validate().map_err(|e| bad(&e))?;
            Ok(Spec::Nats(config, settings.ensure_stream))
        }
        #[cfg(feature = "amqp")]
        "amqp" => {
            let settings = broker.amqp.clone().with_env().map_err(|e| bad(&e))?;
            let config =
                pgoutbox_amqp::AmqpConfig::from_settings(&settings).map_err(|e| bad(&e))?;
            let exchange = config.routing.exchange().to_string();
            let mut rules = pgoutbox_amqp::AmqpRouting::new(exchange.clone());
            // A destination is `exchange/routing_key`, or a routing key on the default exchange.
            let split = |dest: &str| match dest.split_once('/') {
                Some((ex, key)) => (ex.to_string(), key.to_string()),
                None => (exchange.clone(), dest.to_string()),
            };
            for (event_type, dest) in &routing.event_type {
                let (ex, key) = split(dest);
                rules = rules.event_type(event_type, ex, key);
            }
            for (aggregate_type, dest) in &routing.aggregate_type {
                let (ex, key) = split(dest);
                rules = rules.aggregate_type(aggregate_type, ex, key);
            }
            let config = config.routing(rules).envelope(envelope.clone());
            config.validate().map_err(|e| bad(&e))?;
            Ok(Spec::Amqp(config))
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            let settings = broker.kafka.clone().with_env().map_err(|e| bad(&e))?;
            let mut config = pgoutbox_kafka::KafkaConfig::from_settings(&settings)
                .map_err(|e| bad(&e))?
                .envelope(envelope.clone());
            for (event_type, topic) in &routing.event_type {
                config = config.route_event_type(event_type, topic);
            }
            for (aggregate_type, topic) in &routing.aggregate_type {
                config = config.route_aggregate_type(aggregate_type, topic);
            }
            match settings.create_topics_with_partitions {
                Some(n) if n < 1 => Err(bad(&format!(
                    "create_topics_with_partitions = {n}: expected at least 1"
                ))),
                Some(_) if config.named_topics().is_empty() => Err(bad(
                    &"create_topics_with_partitions names no topic: set topic or [routing] rules",
                )),
                partitions => Ok(Spec::Kafka(config, partitions)),
            }
        }
        #[cfg(feature = "sqs")]
        "sqs" => {
            let settings = broker.sqs.clone().with_env().map_err(|e| bad(&e))?;
            let mut config =
                pgoutbox_sqs::SqsConfig::from_settings(&settings).envelope(envelope.clone());
            for (event_type, queue) in &routing.event_type {
                config = config.route_event_type(event_type, queue);
            }
            for (aggregate_type, queue) in &routing.aggregate_type {
                config = config.route_aggregate_type(aggregate_type, queue);
            }
            Ok(Spec::Sqs(config))
        }
        _ => {
            if !routing.event_type.is_empty() || !routing.aggregate_type.is_empty() {
                tracing::warn!("broker stdout: [routing] rules are ignored");
            }
            Ok(Spec::Stdout)
        }
    }
}
