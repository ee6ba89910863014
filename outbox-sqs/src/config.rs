//! [`SqsConfig`]: where to send, how long to wait.

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_sdk_sqs::config::{Credentials, Region};
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::settings::{settings_and_envelope, ConfigError, HumanDuration, WithSetting};

use crate::error::{Error, Result};
use crate::publisher::SqsPublisher;
use crate::routing::{parse_target, Routing};

/// SQS's largest message (body plus attributes), in bytes: 256 KiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 256 * 1024;

pgoutbox_core::settings::env_settings! {
    /// SQS settings as a configuration file or the environment writes them, every
    /// one optional (unset: the default of [`SqsConfig`]). The `outbox` binary reads
    /// its `[broker.sqs]` section into this, lays the environment over it
    /// ([`EnvOverrides::with_env`](crate::EnvOverrides::with_env)) and builds the
    /// config with [`SqsConfig::from_settings`].
    pub struct SqsSettings {
        /// [`SqsConfig::queue`]: the default queue, a queue URL or name.
        #[env(ENV_QUEUE = "OUTBOX_SQS_QUEUE")]
        queue: Option<String>,
        /// [`SqsConfig::queue_prefix`]: the queue name prefix of the default route.
        #[env(ENV_QUEUE_PREFIX = "OUTBOX_SQS_QUEUE_PREFIX")]
        queue_prefix: Option<String>,
        /// [`SqsConfig::endpoint`], e.g. `http://127.0.0.1:5000` for moto.
        #[env(ENV_ENDPOINT = "OUTBOX_SQS_ENDPOINT")]
        endpoint: Option<String>,
        /// [`SqsConfig::region`] (else the AWS chain: `AWS_REGION`, profile...).
        #[env(ENV_REGION = "OUTBOX_SQS_REGION")]
        region: Option<String>,
        /// [`SqsConfig::timeout`] of one SQS call, e.g. `"10s"`.
        #[env(ENV_TIMEOUT_MS = "OUTBOX_SQS_TIMEOUT_MS", millis)]
        timeout: Option<HumanDuration>,
    }
    type Error = Error;
}

/// Configuration of an [`SqsPublisher`]; [`SqsConfig::build`] validates it, loads the
/// AWS configuration (credentials and region from the usual chain) and creates the client.
#[derive(Debug, Clone)]
#[must_use]
pub struct SqsConfig {
    pub(crate) routing: Routing,
    pub(crate) endpoint: Option<String>,
    pub(crate) region: Option<String>,
    pub(crate) credentials: Option<(String, String)>,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) max_message_bytes: usize,
    pub(crate) concurrency: usize,
    pub(crate) envelope: Envelope,
}

impl Default for SqsConfig {
    fn default() -> Self {
        Self {
            routing: Routing::default(),
            endpoint: None,
            region: None,
            credentials: None,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            max_attempts: 3,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            concurrency: 8,
            envelope: Envelope::default(),
        }
    }
}

/// `from_settings` sets what the settings set, one line each.
impl WithSetting for SqsConfig {}

impl SqsConfig {
    /// A configuration sending every event to `queue` (a queue URL, or a name resolved
    /// once with `GetQueueUrl`).
    pub fn new(queue: impl Into<String>) -> Self {
        Self::default().queue(queue)
    }

    /// Read the environment ([`SqsSettings`]'s
    /// [`EnvOverrides::with`](crate::EnvOverrides::with) lists the variables, all
    /// optional) and the envelope ([`Envelope::from_lookup`]: `OUTBOX_ENVELOPE`,
    /// `OUTBOX_CLOUDEVENTS_*`). Credentials come from the AWS chain.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars())
    }

    /// Like [`SqsConfig::from_env`], from the given variables.
    pub fn from_vars<S: Into<String>>(vars: impl IntoIterator<Item = (S, S)>) -> Result<Self> {
        let (settings, envelope) = settings_and_envelope::<SqsSettings>(vars)?;
        Ok(Self::from_settings(&settings)?.envelope(envelope))
    }

    /// Defaults overridden by `settings` (a configuration file's section, the
    /// environment laid over it). A `Result`, as every adapter's `from_settings`:
    /// none of today's SQS settings can be refused here (the region and the queue
    /// are checked when the publisher is built).
    pub fn from_settings(settings: &SqsSettings) -> Result<Self> {
        let s = settings;
        Ok(Self::default()
            .with_setting(&s.queue, Self::queue)
            .with_setting(&s.queue_prefix, Self::queue_prefix)
            .with_setting(&s.endpoint, Self::endpoint)
            .with_setting(&s.region, Self::region)
            .with_setting(&s.timeout, |c, timeout| c.timeout(timeout.into())))
    }

    /// Encode events with this envelope: the outbox envelope (default) or
    /// CloudEvents (attributes `ce-*` in binary mode; see the crate docs).
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.envelope = envelope;
        self
    }

    /// Send every event without a more specific route to this queue (URL or name).
    /// Defaults to none: the queue is named `<prefix><aggregate_type>`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.routing.queues.default = Some(queue.into());
        self
    }

    /// Default route without a default queue: the queue named `<prefix><aggregate_type>`.
    /// Defaults to the empty prefix.
    pub fn queue_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.routing.queues.prefix = prefix.into();
        self
    }

    pgoutbox_core::routing::route_builders! {
        /// Send events of this aggregate type to `queue` (URL or name). Defaults to no such route.
        pub fn route_aggregate_type(aggregate_type, queue)
            => routing.queues.rules.insert_aggregate_type;

        /// Send events of this event type to `queue` (URL or name); wins over an aggregate
        /// type route, loses to the event's own destination. Defaults to no such route.
        pub fn route_event_type(event_type, queue) => routing.queues.rules.insert_event_type;
    }

    /// Talk to this endpoint instead of AWS's (moto, LocalStack). Defaults to none.
    pub fn endpoint(mut self, url: impl Into<String>) -> Self {
        self.endpoint = Some(url.into());
        self
    }

    /// Use this region. Defaults to the AWS chain (`AWS_REGION`, profile, IMDS).
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// Use these static credentials (tests, local endpoints). Defaults to the AWS
    /// credentials chain (environment, profile, web identity, container, IMDS).
    pub fn credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
    ) -> Self {
        self.credentials = Some((access_key_id.into(), secret_access_key.into()));
        self
    }

    /// Longest time one SQS call may take, the SDK's retries included; after it the
    /// events of the call fail as retryable. Defaults to 10 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Longest time to open a connection. Defaults to 3 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Attempts the SDK makes per call (throttling, 5xx, network errors) before the
    /// events fail as retryable. Defaults to 3.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Largest message (body plus attributes) and largest `SendMessageBatch` request;
    /// a bigger event fails permanently without being sent. Defaults to 256 KiB,
    /// SQS's limit; raise it only where the queue allows more.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// Most `SendMessageBatch` calls in flight for one publish (FIFO queues get one
    /// call at a time, to keep group order). Defaults to 8.
    pub fn concurrency(mut self, calls: usize) -> Self {
        self.concurrency = calls;
        self
    }

    /// Validate, load the AWS configuration and create the publisher. No SQS call is
    /// made (see [`pgoutbox_core::Publisher::check`]).
    pub async fn build(self) -> Result<SqsPublisher> {
        self.validate()?;
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_timeout(self.timeout)
                    .connect_timeout(self.connect_timeout)
                    .build(),
            )
            .retry_config(RetryConfig::standard().with_max_attempts(self.max_attempts));
        if let Some(region) = &self.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some(endpoint) = &self.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some((key, secret)) = &self.credentials {
            loader = loader.credentials_provider(Credentials::new(
                key,
                secret,
                None,
                None,
                "outbox-sqs-static",
            ));
        }
        let sdk = loader.load().await;
        if sdk.region().is_none() {
            return Err(ConfigError::new(
                "region",
                "no AWS region; set AWS_REGION, OUTBOX_SQS_REGION or SqsConfig::region",
            )
            .into());
        }
        Ok(SqsPublisher::from_client(
            aws_sdk_sqs::Client::new(&sdk),
            self,
        ))
    }

    fn validate(&self) -> Result<()> {
        for queue in self.routing.queues.named() {
            parse_target(queue)?;
        }
        if let Some(endpoint) = &self.endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(ConfigError::new(
                    "endpoint",
                    format!("{endpoint:?} is not an http(s) URL"),
                )
                .into());
            }
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(ConfigError::new("timeout", "timeouts must be positive").into());
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::new("max_attempts", "at least 1").into());
        }
        if self.max_message_bytes < 1024 {
            return Err(ConfigError::new(
                "max_message_bytes",
                format!(
                    "{} is too small; SQS allows 256 KiB",
                    self.max_message_bytes
                ),
            )
            .into());
        }
        if self.concurrency == 0 {
            return Err(ConfigError::new("concurrency", "at least 1").into());
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
        let c = SqsConfig::from_vars([
            (ENV_QUEUE, "orders.fifo"),
            (ENV_ENDPOINT, "http://127.0.0.1:5000"),
            (ENV_REGION, "eu-west-1"),
            (ENV_TIMEOUT_MS, "2500"),
        ])
        .unwrap();
        assert_eq!(c.routing.queues.default.as_deref(), Some("orders.fifo"));
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(c.region.as_deref(), Some("eu-west-1"));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        let err = SqsConfig::from_vars([(ENV_TIMEOUT_MS, "soon")]).unwrap_err();
        assert!(err.to_string().contains(ENV_TIMEOUT_MS), "{err}");
        assert!(
            matches!(&err, Error::Config(e) if e.key == ENV_TIMEOUT_MS),
            "{err}"
        );
        let err = SqsConfig::from_vars([("OUTBOX_ENVELOPE", "cloudevents-binary")]).unwrap_err();
        assert!(
            matches!(&err, Error::Config(e) if e.key == "envelope.source"),
            "{err}"
        );
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        let file: SqsSettings =
            toml::from_str("queue = \"file-q\"\nregion = \"eu-west-1\"\ntimeout = \"3s\"").unwrap();
        let settings = file.with_vars([(ENV_QUEUE, "env-q")]).unwrap();
        let c = SqsConfig::from_settings(&settings).unwrap();
        assert_eq!(c.routing.queues.default.as_deref(), Some("env-q"));
        assert_eq!(c.region.as_deref(), Some("eu-west-1"));
        assert_eq!(c.timeout, Duration::from_secs(3));
    }

    #[tokio::test]
    async fn invalid_settings_are_refused() {
        assert!(SqsConfig::new("bad queue").build().await.is_err());
        assert!(SqsConfig::new("q")
            .endpoint("127.0.0.1:5000")
            .build()
            .await
            .is_err());
        assert!(SqsConfig::new("q").max_attempts(0).build().await.is_err());
        assert!(SqsConfig::new("q")
            .timeout(Duration::ZERO)
            .build()
            .await
            .is_err());
    }
}
