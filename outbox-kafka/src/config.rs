//! [`KafkaConfig`]: where to connect, how to route, how long to wait.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::settings::{
    settings_and_envelope, ConfigError, HumanDuration, Vars, WithSetting,
};
use rdkafka::config::ClientConfig;

use crate::error::{Error, Result};
use crate::publisher::KafkaPublisher;
use crate::routing::{validate_topic, Routing};

/// Prefix of environment variables passed to librdkafka: `OUTBOX_KAFKA_RDKAFKA_SECURITY_PROTOCOL=SASL_SSL`
/// sets `security.protocol` (name lower-cased, `_` turned into `.`).
pub const ENV_RDKAFKA_PREFIX: &str = "OUTBOX_KAFKA_RDKAFKA_";

/// `linger.ms` unless the configuration sets it. A publisher call queues its events
/// and waits for all their deliveries; until they are in, its claim loop sends
/// nothing more, so lingering for more messages only delays them. Per-aggregate
/// order makes it worse: a hot aggregate's run goes out one event per call, and
/// librdkafka's default of 5 ms held each of them back (164 events/s for one
/// aggregate into tansu, 1,801 with 0; docs/benchmarks-history.md, "Hot aggregates into Kafka").
const LINGER_MS: &str = "0";

pgoutbox_core::settings::env_settings! {
    /// Kafka settings as a configuration file or the environment writes them, every
    /// one optional (unset: the default of [`KafkaConfig`]; `brokers` is required).
    /// The `outbox` binary reads its `[broker.kafka]` section into this, lays the
    /// environment over it ([`EnvOverrides::with_env`](crate::EnvOverrides::with_env))
    /// and builds the config with [`KafkaConfig::from_settings`].
    pub struct KafkaSettings {
        /// The bootstrap servers, `host:port[,host:port...]`. Required by
        /// [`KafkaConfig::from_settings`] and [`KafkaConfig::from_env`].
        #[env(ENV_BROKERS = "OUTBOX_KAFKA_BROKERS")]
        brokers: Option<String>,
        /// [`KafkaConfig::topic_prefix`]: the topic prefix of the default route.
        #[env(ENV_TOPIC_PREFIX = "OUTBOX_KAFKA_TOPIC_PREFIX")]
        topic_prefix: Option<String>,
        /// [`KafkaConfig::topic`]: one topic for all events without a more specific
        /// route.
        #[env(ENV_TOPIC = "OUTBOX_KAFKA_TOPIC")]
        topic: Option<String>,
        /// [`KafkaConfig::delivery_timeout`], e.g. `"20s"`.
        #[env(ENV_DELIVERY_TIMEOUT_MS = "OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS", millis)]
        delivery_timeout: Option<HumanDuration>,
        /// [`KafkaConfig::queue_timeout`], the wait for room in the local queue, e.g. `"5s"`.
        #[env(ENV_QUEUE_TIMEOUT_MS = "OUTBOX_KAFKA_QUEUE_TIMEOUT_MS", millis)]
        queue_timeout: Option<HumanDuration>,
        /// A file holding the SASL password (`sasl.password`), e.g. a mounted secret;
        /// the file's text without its trailing line break.
        #[env(ENV_SASL_PASSWORD_FILE = "OUTBOX_KAFKA_SASL_PASSWORD_FILE")]
        sasl_password_file: Option<PathBuf>,
        /// Create the topics this configuration names ([`KafkaConfig::named_topics`])
        /// when missing, with this many partitions, before publishing
        /// ([`KafkaConfig::ensure_topic`]; the `outbox` binary's `relay` and `migrate`
        /// do), for clusters that do not create topics on first use. No environment
        /// variable: a deployment decision.
        create_topics_with_partitions: Option<i32>,
        /// librdkafka properties ([`KafkaConfig::set`]), e.g. `"security.protocol" = "SASL_SSL"`;
        /// the `OUTBOX_KAFKA_RDKAFKA_<NAME>` variables ([`ENV_RDKAFKA_PREFIX`]) add to them.
        properties: BTreeMap<String, String>,
    }
    type Error = Error;
    /// | `OUTBOX_KAFKA_RDKAFKA_<NAME>` | `properties`: `<name>` lower-cased, `_` turned into `.` |
    then with_rdkafka_properties;
}

impl KafkaSettings {
    /// The `OUTBOX_KAFKA_RDKAFKA_<NAME>` variables laid over `properties`.
    fn with_rdkafka_properties(mut self, vars: &Vars) -> Result<Self> {
        for (name, value) in vars.with_prefix(ENV_RDKAFKA_PREFIX) {
            if name.is_empty() {
                return Err(ConfigError::new(
                    ENV_RDKAFKA_PREFIX,
                    format!("`{value}`: no librdkafka property name after the prefix"),
                )
                .into());
            }
            let key = format!("properties.{}", name.to_ascii_lowercase().replace('_', "."));
            self.set_config(&key, value)
                .map_err(|e| ConfigError::new(format!("{ENV_RDKAFKA_PREFIX}{name}"), e.reason))?;
        }
        Ok(self)
    }
}

/// Configuration of a [`KafkaPublisher`]; [`KafkaConfig::build`] validates it and
/// creates the producer.
///
/// The producer is always idempotent with `acks=all` unless overridden with
/// [`KafkaConfig::set`], so retries inside librdkafka neither duplicate nor reorder
/// messages of one partition.
///
/// Its `Debug` output shows librdkafka settings whose name holds `password` or
/// `secret` as `<redacted>`.
#[derive(Clone)]
#[must_use]
pub struct KafkaConfig {
    pub(crate) brokers: String,
    pub(crate) routing: Routing,
    pub(crate) delivery_timeout: Duration,
    pub(crate) queue_timeout: Duration,
    pub(crate) client: BTreeMap<String, String>,
    pub(crate) envelope: Envelope,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let client: BTreeMap<&str, &str> = self
            .client
            .iter()
            .map(|(name, value)| {
                let secret = name.contains("password") || name.contains("secret");
                (
                    name.as_str(),
                    if secret { "<redacted>" } else { value.as_str() },
                )
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("routing", &self.routing)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("queue_timeout", &self.queue_timeout)
            .field("client", &client)
            .field("envelope", &self.envelope)
            .finish()
    }
}

/// `from_settings` sets what the settings set, one line each.
impl WithSetting for KafkaConfig {}

impl KafkaConfig {
    /// A configuration for these bootstrap servers (`host:port[,host:port...]`).
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            routing: Routing::default(),
            delivery_timeout: Duration::from_secs(20),
            queue_timeout: Duration::from_secs(5),
            client: BTreeMap::new(),
            envelope: Envelope::default(),
        }
    }

    /// Read the configuration from the environment ([`KafkaSettings`]'s
    /// [`EnvOverrides::with`](crate::EnvOverrides::with) lists the variables;
    /// `OUTBOX_KAFKA_BROKERS` is required) and the envelope ([`Envelope::from_lookup`]:
    /// `OUTBOX_ENVELOPE`, `OUTBOX_CLOUDEVENTS_*`).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars())
    }

    /// Like [`KafkaConfig::from_env`], from the given variables.
    pub fn from_vars<S: Into<String>>(vars: impl IntoIterator<Item = (S, S)>) -> Result<Self> {
        let (settings, envelope) = settings_and_envelope::<KafkaSettings>(vars)?;
        Ok(Self::from_settings(&settings)?.envelope(envelope))
    }

    /// The configuration `settings` give (a configuration file's section, the
    /// environment laid over it): `brokers` is required; the SASL password file
    /// is read here, and `properties` win over it.
    pub fn from_settings(settings: &KafkaSettings) -> Result<Self> {
        let s = settings;
        let brokers = s.brokers.clone().ok_or_else(|| {
            ConfigError::new(
                "brokers",
                format!(
                    "not set: set it ({ENV_BROKERS}) to the bootstrap servers, e.g. 127.0.0.1:9092"
                ),
            )
        })?;
        let sasl_password = s
            .sasl_password_file
            .as_deref()
            .map(|path| {
                pgoutbox_core::read_secret_file(path).map_err(|e| {
                    ConfigError::new(
                        format!("sasl_password_file ({ENV_SASL_PASSWORD_FILE})"),
                        e.to_string(),
                    )
                })
            })
            .transpose()?;
        let mut config = Self::new(brokers)
            .with_setting(&s.topic_prefix, Self::topic_prefix)
            .with_setting(&s.topic, Self::topic)
            .with_setting(&s.delivery_timeout, |c, timeout| {
                c.delivery_timeout(timeout.into())
            })
            .with_setting(&s.queue_timeout, |c, timeout| {
                c.queue_timeout(timeout.into())
            })
            .with_setting(&sasl_password, |c, password| {
                c.set("sasl.password", password)
            });
        for (name, value) in &s.properties {
            config = config.set(name.clone(), value.clone());
        }
        Ok(config)
    }

    /// Encode events with this envelope: the outbox envelope (default) or
    /// CloudEvents (binary mode: `ce_` headers, as the CloudEvents Kafka binding says).
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.envelope = envelope;
        self
    }

    /// Default route: topic `<prefix><aggregate_type>`. Defaults to the empty prefix,
    /// so events of aggregate type `order` go to topic `order`.
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.routing.topics.prefix = prefix.into();
        self
    }

    /// Send every event without a more specific route (destination, event type,
    /// aggregate type) to this one topic instead of `<prefix><aggregate_type>`.
    /// Defaults to none.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.routing.topics.default = Some(topic.into());
        self
    }

    /// The topics this configuration names: the default topic and every route's,
    /// sorted, without repeats (topics from the prefix rule are not known in
    /// advance). For creating them up front ([`KafkaConfig::ensure_topic`]).
    pub fn named_topics(&self) -> Vec<String> {
        let topics: std::collections::BTreeSet<&str> = self.routing.topics.named().collect();
        topics.into_iter().map(str::to_string).collect()
    }

    pgoutbox_core::routing::route_builders! {
        /// Send events of this aggregate type to `topic`. Defaults to no such route.
        pub fn route_aggregate_type(aggregate_type, topic)
            => routing.topics.rules.insert_aggregate_type;

        /// Send events of this event type to `topic`; wins over an aggregate type route,
        /// loses to the event's own destination. Defaults to no such route.
        pub fn route_event_type(event_type, topic) => routing.topics.rules.insert_event_type;
    }

    /// Longest time librdkafka tries to deliver a message (`message.timeout.ms`),
    /// retries included; after it the event fails as retryable. Keep it below the
    /// relay's publish timeout. Defaults to 20 s.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// Longest wait for room in librdkafka's local queue when it is full; events not
    /// queued by then fail as retryable. Defaults to 5 s.
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        self.queue_timeout = timeout;
        self
    }

    /// Set any librdkafka property (security, compression, linger...). Applied after
    /// the properties this crate sets, so it can override them, `enable.idempotence`
    /// and `acks` included (which gives up the ordering and no-duplicate guarantees).
    ///
    /// Set by this crate: `bootstrap.servers`, `enable.idempotence=true`,
    /// `enable.gapless.guarantee=true`, `max.in.flight.requests.per.connection=5`
    /// (what keeps an aggregate's pipelined run in order), `acks=all`,
    /// `message.timeout.ms` (from [`KafkaConfig::delivery_timeout`]),
    /// `topic.metadata.propagation.max.ms=5000` (how long a missing topic may take to
    /// appear before its events fail permanently as unknown topic) and `linger.ms=0`
    /// (send at once; librdkafka's own default waits 5 ms for more messages, which
    /// the relay never sends while it waits for the deliveries of a call).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.insert(key.into(), value.into());
        self
    }

    /// The bootstrap servers.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The librdkafka configuration this config produces.
    pub fn client_config(&self) -> Result<ClientConfig> {
        self.validate()?;
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", &self.brokers)
            .set("enable.idempotence", "true")
            .set("enable.gapless.guarantee", "true")
            .set("max.in.flight.requests.per.connection", "5")
            .set("acks", "all")
            .set(
                "message.timeout.ms",
                self.delivery_timeout.as_millis().to_string(),
            )
            .set("topic.metadata.propagation.max.ms", "5000")
            .set("linger.ms", LINGER_MS);
        for (key, value) in &self.client {
            client.set(key, value);
        }
        Ok(client)
    }

    /// Validate and create the publisher (no connection is made yet; see
    /// [`pgoutbox_core::Publisher::check`]).
    pub fn build(self) -> Result<KafkaPublisher> {
        KafkaPublisher::new(self)
    }

    fn validate(&self) -> Result<()> {
        if self.brokers.trim().is_empty() {
            return Err(ConfigError::new("brokers", "empty; give host:port[,host:port...]").into());
        }
        let ms = self.delivery_timeout.as_millis();
        if ms == 0 || ms > i32::MAX as u128 {
            return Err(ConfigError::new(
                "delivery_timeout",
                format!("{ms} ms; must be between 1 ms and {} ms", i32::MAX),
            )
            .into());
        }
        if self.queue_timeout.is_zero() {
            return Err(ConfigError::new("queue_timeout", "must be positive").into());
        }
        for topic in self.routing.topics.named() {
            validate_topic(topic)?;
        }
        if let Some(key) = self.client.keys().find(|k| k.trim().is_empty()) {
            return Err(ConfigError::new(
                "client",
                format!("empty librdkafka property name {key:?}"),
            )
            .into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EnvOverrides;

    #[test]
    fn from_vars_reads_everything() {
        let config = KafkaConfig::from_vars([
            (ENV_BROKERS, "a:9092,b:9092"),
            (ENV_TOPIC_PREFIX, "events."),
            (ENV_DELIVERY_TIMEOUT_MS, "1500"),
            ("OUTBOX_KAFKA_RDKAFKA_COMPRESSION_TYPE", "lz4"),
            ("UNRELATED", "x"),
        ])
        .unwrap();
        assert_eq!(config.brokers(), "a:9092,b:9092");
        assert_eq!(config.routing.topics.prefix, "events.");
        assert_eq!(config.delivery_timeout, Duration::from_millis(1500));
        let client = config.client_config().unwrap();
        assert_eq!(client.get("compression.type"), Some("lz4"));
        assert_eq!(client.get("enable.idempotence"), Some("true"));
        assert_eq!(client.get("acks"), Some("all"));
        assert_eq!(client.get("message.timeout.ms"), Some("1500"));
        assert_eq!(client.get("linger.ms"), Some("0"));
        assert_eq!(client.get("enable.gapless.guarantee"), Some("true"));
        assert_eq!(
            client.get("max.in.flight.requests.per.connection"),
            Some("5")
        );
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        let file: KafkaSettings = toml::from_str(
            r#"
            brokers = "file:9092"
            topic = "events"
            queue_timeout = "2s"
            create_topics_with_partitions = 3
            [properties]
            "compression.type" = "gzip"
            "linger.ms" = "5"
            "#,
        )
        .unwrap();
        let settings = file
            .with_vars([
                (ENV_BROKERS, "env:9092"),
                ("OUTBOX_KAFKA_RDKAFKA_COMPRESSION_TYPE", "lz4"),
            ])
            .unwrap();
        assert_eq!(settings.create_topics_with_partitions, Some(3));
        let config = KafkaConfig::from_settings(&settings).unwrap();
        assert_eq!(config.brokers(), "env:9092");
        assert_eq!(config.queue_timeout, Duration::from_secs(2));
        assert_eq!(config.named_topics(), ["events"]);
        let client = config.client_config().unwrap();
        assert_eq!(client.get("compression.type"), Some("lz4"));
        assert_eq!(client.get("linger.ms"), Some("5"));
    }

    #[test]
    fn key_value_text_reads_as_the_file_does() {
        let text: KafkaSettings = toml::from_str(
            r#"
            brokers = "a:9092"
            queue_timeout = "2s"
            create_topics_with_partitions = 3
            [properties]
            "security.protocol" = "SASL_SSL"
            "#,
        )
        .unwrap();
        let keyed = [
            ("brokers", "a:9092"),
            ("queue_timeout", "2s"),
            ("create_topics_with_partitions", "3"),
            ("properties.security.protocol", "SASL_SSL"),
        ]
        .into_iter()
        .try_fold(KafkaSettings::default(), |s, (key, value)| {
            s.with_config(key, value)
        })
        .unwrap();
        assert_eq!(keyed, text);
        let err = KafkaSettings::default()
            .with_config("partitions", "3")
            .unwrap_err();
        assert!(
            matches!(&err, Error::Config(e) if e.key == "partitions"),
            "{err}"
        );
        let err = KafkaSettings::default()
            .with_config("create_topics_with_partitions", "three")
            .unwrap_err();
        assert!(
            matches!(&err, Error::Config(e) if e.key == "create_topics_with_partitions"),
            "{err}"
        );
    }

    #[test]
    fn debug_output_hides_passwords_and_secrets() {
        let config = KafkaConfig::new("a:9092")
            .set("sasl.username", "app")
            .set("sasl.password", "hunter2")
            .set("sasl.oauthbearer.client.secret", "s3cret");
        let shown = format!("{config:?}");
        assert!(shown.contains("\"sasl.username\": \"app\""), "{shown}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn named_topics_are_the_default_and_the_routes() {
        let config = KafkaConfig::new("a:1")
            .topic("events")
            .route_aggregate_type("order", "orders")
            .route_event_type("order.paid", "payments")
            .route_event_type("order.shipped", "orders");
        assert_eq!(config.named_topics(), ["events", "orders", "payments"]);
        assert!(KafkaConfig::new("a:1").named_topics().is_empty());
    }

    #[test]
    fn missing_brokers_is_named() {
        let err = KafkaConfig::from_vars([("UNRELATED", "x")]).unwrap_err();
        assert!(err.to_string().contains(ENV_BROKERS), "{err}");
        assert!(
            matches!(&err, Error::Config(e) if e.key == "brokers"),
            "{err}"
        );
    }

    #[test]
    fn bad_number_is_named() {
        let err = KafkaConfig::from_vars([(ENV_BROKERS, "a:1"), (ENV_QUEUE_TIMEOUT_MS, "soon")])
            .unwrap_err();
        assert!(err.to_string().contains(ENV_QUEUE_TIMEOUT_MS), "{err}");
        assert!(
            matches!(&err, Error::Config(e) if e.key == ENV_QUEUE_TIMEOUT_MS),
            "{err}"
        );
        let err =
            KafkaConfig::from_vars([(ENV_BROKERS, "a:1"), (ENV_RDKAFKA_PREFIX, "x")]).unwrap_err();
        assert!(
            matches!(&err, Error::Config(e) if e.key == ENV_RDKAFKA_PREFIX),
            "{err}"
        );
    }

    #[test]
    fn invalid_settings_are_refused() {
        assert!(KafkaConfig::new(" ").build().is_err());
        assert!(KafkaConfig::new("a:1")
            .delivery_timeout(Duration::ZERO)
            .build()
            .is_err());
        let err = KafkaConfig::new("a:1")
            .route_event_type("x", "no spaces")
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidTopic { .. }), "{err}");
        let err = KafkaConfig::new("a:1")
            .set("no.such.property", "1")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("no.such.property"), "{err}");
    }
}
