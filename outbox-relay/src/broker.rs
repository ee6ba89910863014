//! The broker the relay publishes to, chosen by `broker.kind` / `OUTBOX_BROKER`.
//!
//! Each adapter reads its own `OUTBOX_<BROKER>_*` variables (`from_vars`); keys of the
//! `[broker.<kind>]` section are the defaults of those variables, so the environment
//! wins over the file as everywhere else. Routing rules come from `[routing]`.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::layer::{MetricsLayer, PublisherExt};
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
    /// Read the broker's configuration. Call before any thread is started: the file's
    /// `[broker.<kind>]` keys become defaults of the adapter's environment variables.
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

/// The adapter's variables: the process environment, with the config file's values
/// as defaults for those the environment does not set (the environment wins).
#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs")),
    allow(dead_code)
)]
struct Vars(std::collections::BTreeMap<String, String>);

#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs")),
    allow(dead_code)
)]
impl Vars {
    fn from_env() -> Self {
        Self(std::env::vars().collect())
    }

    fn default(&mut self, name: &str, value: Option<String>) {
        let set = self.0.get(name).is_some_and(|v| !v.trim().is_empty());
        if let (false, Some(value)) = (set, value) {
            self.0.insert(name.to_string(), value);
        }
    }

    fn take(&mut self) -> std::collections::BTreeMap<String, String> {
        std::mem::take(&mut self.0)
    }
}

#[cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs")),
    allow(dead_code)
)]
fn millis(d: Option<crate::config::Dur>) -> Option<String> {
    d.map(|d| d.0.as_millis().to_string())
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
    #[cfg_attr(
        not(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "sqs")),
        allow(unused_mut, unused_variables)
    )]
    let mut vars = Vars::from_env();
    match kind {
        #[cfg(feature = "nats")]
        "nats" => {
            let file = &broker.nats;
            vars.default(pgoutbox_nats::ENV_URL, file.url.clone());
            vars.default(
                pgoutbox_nats::ENV_SUBJECT_PREFIX,
                file.subject_prefix.clone(),
            );
            vars.default(pgoutbox_nats::ENV_TIMEOUT_MS, millis(file.timeout));
            vars.default(
                pgoutbox_nats::ENV_MAX_IN_FLIGHT,
                file.max_in_flight.map(|n| n.to_string()),
            );
            vars.default(pgoutbox_nats::ENV_CLIENT_NAME, file.client_name.clone());
            vars.default(pgoutbox_nats::ENV_USER, file.user.clone());
            vars.default(pgoutbox_nats::ENV_PASSWORD, file.password.clone());
            vars.default(pgoutbox_nats::ENV_TOKEN, file.token.clone());
            vars.default(pgoutbox_nats::ENV_PASSWORD_FILE, file.password_file.clone());
            vars.default(pgoutbox_nats::ENV_TOKEN_FILE, file.token_file.clone());
            vars.default(
                pgoutbox_nats::ENV_TLS_REQUIRED,
                file.tls_required.map(|b| b.to_string()),
            );
            vars.default(pgoutbox_nats::ENV_TLS_CA, file.tls_ca.clone());
            vars.default(pgoutbox_nats::ENV_TLS_CERT, file.tls_cert.clone());
            vars.default(pgoutbox_nats::ENV_TLS_KEY, file.tls_key.clone());
            vars.default(pgoutbox_nats::ENV_CREDS, file.creds.clone());
            vars.default(pgoutbox_nats::ENV_NKEY_FILE, file.nkey_file.clone());
            let config = pgoutbox_nats::NatsConfig::from_vars(vars.take()).map_err(|e| bad(&e))?;
            let mut rules = pgoutbox_nats::SubjectRouting::new(config.routing.prefix());
            for (event_type, subject) in &routing.event_type {
                rules = rules.event_type(event_type, subject);
            }
            for (aggregate_type, subject) in &routing.aggregate_type {
                rules = rules.aggregate_type(aggregate_type, subject);
            }
            let config = config.routing(rules).envelope(envelope.clone());
            config.validate().map_err(|e| bad(&e))?;
            Ok(Spec::Nats(config, file.ensure_stream.clone()))
        }
        #[cfg(feature = "amqp")]
        "amqp" => {
            let file = &broker.amqp;
            vars.default(pgoutbox_amqp::ENV_URL, file.url.clone());
            vars.default(pgoutbox_amqp::ENV_EXCHANGE, file.exchange.clone());
            vars.default(pgoutbox_amqp::ENV_TIMEOUT_MS, millis(file.timeout));
            vars.default(
                pgoutbox_amqp::ENV_CONNECTION_NAME,
                file.connection_name.clone(),
            );
            vars.default(pgoutbox_amqp::ENV_PASSWORD_FILE, file.password_file.clone());
            vars.default(pgoutbox_amqp::ENV_TLS_CA, file.tls_ca.clone());
            let config = pgoutbox_amqp::AmqpConfig::from_vars(vars.take()).map_err(|e| bad(&e))?;
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
            use pgoutbox_kafka::{
                ENV_BROKERS, ENV_DELIVERY_TIMEOUT_MS, ENV_QUEUE_TIMEOUT_MS, ENV_RDKAFKA_PREFIX,
                ENV_SASL_PASSWORD_FILE, ENV_TOPIC, ENV_TOPIC_PREFIX,
            };
            let file = &broker.kafka;
            vars.default(ENV_BROKERS, file.brokers.clone());
            vars.default(ENV_TOPIC_PREFIX, file.topic_prefix.clone());
            vars.default(ENV_TOPIC, file.topic.clone());
            vars.default(ENV_DELIVERY_TIMEOUT_MS, millis(file.delivery_timeout));
            vars.default(ENV_QUEUE_TIMEOUT_MS, millis(file.queue_timeout));
            vars.default(ENV_SASL_PASSWORD_FILE, file.sasl_password_file.clone());
            let mut config = pgoutbox_kafka::KafkaConfig::from_vars(vars.take())
                .map_err(|e| bad(&e))?
                .envelope(envelope.clone());
            for (key, value) in &file.properties {
                let var = format!(
                    "{ENV_RDKAFKA_PREFIX}{}",
                    key.to_ascii_uppercase().replace('.', "_")
                );
                if std::env::var(&var).is_err() {
                    config = config.set(key, value);
                }
            }
            for (event_type, topic) in &routing.event_type {
                config = config.route_event_type(event_type, topic);
            }
            for (aggregate_type, topic) in &routing.aggregate_type {
                config = config.route_aggregate_type(aggregate_type, topic);
            }
            match file.create_topics_with_partitions {
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
            use pgoutbox_sqs::{
                ENV_ENDPOINT, ENV_QUEUE, ENV_QUEUE_PREFIX, ENV_REGION, ENV_TIMEOUT_MS,
            };
            let file = &broker.sqs;
            vars.default(ENV_QUEUE, file.queue.clone());
            vars.default(ENV_QUEUE_PREFIX, file.queue_prefix.clone());
            vars.default(ENV_ENDPOINT, file.endpoint.clone());
            vars.default(ENV_REGION, file.region.clone());
            vars.default(ENV_TIMEOUT_MS, millis(file.timeout));
            let mut config = pgoutbox_sqs::SqsConfig::from_vars(vars.take())
                .map_err(|e| bad(&e))?
                .envelope(envelope.clone());
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

#[cfg(test)]
mod vars_tests {
    use super::Vars;

    #[test]
    fn environment_wins_over_the_file_and_empty_values_count_as_unset() {
        let mut vars = Vars(
            [
                ("OUTBOX_X_URL".to_string(), "from-env".to_string()),
                ("OUTBOX_X_NAME".to_string(), " ".to_string()),
            ]
            .into_iter()
            .collect(),
        );
        vars.default("OUTBOX_X_URL", Some("from-file".into()));
        vars.default("OUTBOX_X_NAME", Some("file-name".into()));
        vars.default("OUTBOX_X_TIMEOUT_MS", Some("500".into()));
        vars.default("OUTBOX_X_USER", None);
        let map = vars.take();
        assert_eq!(map["OUTBOX_X_URL"], "from-env");
        assert_eq!(map["OUTBOX_X_NAME"], "file-name");
        assert_eq!(map["OUTBOX_X_TIMEOUT_MS"], "500");
        assert!(!map.contains_key("OUTBOX_X_USER"));
    }
}
