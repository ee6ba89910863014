//! Configuration of the [`AmqpPublisher`]: defaults, environment, validation.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use lapin::uri::AMQPUri;
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::redact_url;
use pgoutbox_core::settings::{settings_and_envelope, HumanDuration, WithSetting};

use crate::error::{Error, Result};
use crate::publisher::AmqpPublisher;
use crate::routing::AmqpRouting;

/// Default broker URL: a local RabbitMQ with the guest account.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How to reach the broker and where to publish.
///
/// ```no_run
/// # async fn demo() -> Result<(), pgoutbox_amqp::Error> {
/// use pgoutbox_amqp::{AmqpConfig, AmqpRouting};
/// let publisher = AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
///     .routing(AmqpRouting::new("shop.events"))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AmqpConfig {
    /// Broker URL (`amqp://user:password@host:port/vhost`). Defaults to [`DEFAULT_URL`].
    pub url: String,
    /// Exchange and routing key rule. Defaults to exchange `outbox`, routing key = event type.
    pub routing: AmqpRouting,
    /// Longest wait for connecting, sending a message and its publisher confirm; a
    /// message not confirmed in time is a retryable failure. Defaults to 10 s.
    pub timeout: Duration,
    /// Connection name shown by the broker. Defaults to `pgoutbox-relay`.
    pub connection_name: String,
    /// The password, replacing the URL's (e.g. read from a mounted secret with
    /// `OUTBOX_AMQP_PASSWORD_FILE`). Defaults to none: the URL's.
    pub password: Option<String>,
    /// A CA certificate file (PEM) to trust for an `amqps://` URL, for a broker
    /// certificate of your own CA; else the system's roots. Defaults to none.
    pub tls_ca_file: Option<PathBuf>,
    /// How events become messages: the outbox envelope (default) or CloudEvents.
    pub envelope: Envelope,
}

pgoutbox_core::settings::env_settings! {
    /// AMQP settings as a configuration file or the environment writes them, every
    /// one optional (unset: the default of [`AmqpConfig`]). The `outbox` binary reads
    /// its `[broker.amqp]` section into this, lays the environment over it
    /// ([`EnvOverrides::with_env`](crate::EnvOverrides::with_env)) and builds the
    /// config with [`AmqpConfig::from_settings`].
    pub struct AmqpSettings {
        /// [`AmqpConfig::url`].
        #[env(ENV_URL = "OUTBOX_AMQP_URL")]
        url: Option<String>,
        /// Exchange of the default [`AmqpRouting`].
        #[env(ENV_EXCHANGE = "OUTBOX_AMQP_EXCHANGE")]
        exchange: Option<String>,
        /// [`AmqpConfig::timeout`], e.g. `"5s"`.
        #[env(ENV_TIMEOUT_MS = "OUTBOX_AMQP_TIMEOUT_MS", millis)]
        timeout: Option<HumanDuration>,
        /// [`AmqpConfig::connection_name`].
        #[env(ENV_CONNECTION_NAME = "OUTBOX_AMQP_CONNECTION_NAME")]
        connection_name: Option<String>,
        /// [`AmqpConfig::password`], read from this file (a mounted secret).
        #[env(ENV_PASSWORD_FILE = "OUTBOX_AMQP_PASSWORD_FILE")]
        password_file: Option<PathBuf>,
        /// [`AmqpConfig::tls_ca_file`].
        #[env(ENV_TLS_CA = "OUTBOX_AMQP_TLS_CA")]
        tls_ca: Option<PathBuf>,
    }
    type Error = Error;
}

// Not derived: the password is hidden. Destructured so that a new field (a secret,
// perhaps) is shown or hidden on purpose.
impl std::fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            url,
            routing,
            timeout,
            connection_name,
            password,
            tls_ca_file,
            envelope,
        } = self;
        f.debug_struct("AmqpConfig")
            .field("url", &redact_url(url))
            .field("routing", routing)
            .field("timeout", timeout)
            .field("connection_name", connection_name)
            .field("password", &password.as_ref().map(|_| "<redacted>"))
            .field("tls_ca_file", tls_ca_file)
            .field("envelope", envelope)
            .finish()
    }
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self::new(DEFAULT_URL)
    }
}

/// `from_settings` sets what the settings set, one line each.
impl WithSetting for AmqpConfig {}

impl AmqpConfig {
    /// Defaults, with this broker URL.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            routing: AmqpRouting::default(),
            timeout: Duration::from_secs(10),
            connection_name: "pgoutbox-relay".into(),
            password: None,
            tls_ca_file: None,
            envelope: Envelope::default(),
        }
    }

    /// Defaults overridden by the environment ([`AmqpSettings`]'s
    /// [`EnvOverrides::with`](crate::EnvOverrides::with) lists the `OUTBOX_AMQP_*`
    /// variables), and the envelope: `OUTBOX_ENVELOPE`, `OUTBOX_CLOUDEVENTS_*`
    /// ([`Envelope::from_lookup`]). Unset or empty variables keep the default;
    /// unparsable ones are an error.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars())
    }

    /// Like [`AmqpConfig::from_env`], from the given variables.
    pub fn from_vars<S: Into<String>>(vars: impl IntoIterator<Item = (S, S)>) -> Result<Self> {
        let (settings, envelope) = settings_and_envelope::<AmqpSettings>(vars)?;
        Ok(Self::from_settings(&settings)?.envelope(envelope))
    }

    /// Defaults overridden by `settings` (a configuration file's section, the
    /// environment laid over it); the password file is read here.
    pub fn from_settings(settings: &AmqpSettings) -> Result<Self> {
        let s = settings;
        let password = s
            .password_file
            .as_deref()
            .map(|path| {
                pgoutbox_core::read_secret_file(path).map_err(|e| {
                    Error::config(
                        format!("password_file ({ENV_PASSWORD_FILE})"),
                        e.to_string(),
                    )
                })
            })
            .transpose()?;
        Ok(Self::default()
            .with_setting(&s.url, Self::url)
            .with_setting(&s.exchange, |c, exchange| {
                c.routing(AmqpRouting::new(exchange))
            })
            .with_setting(&s.timeout, |c, timeout| c.timeout(timeout.into()))
            .with_setting(&s.connection_name, Self::connection_name)
            .with_setting(&password, Self::password)
            .with_setting(&s.tls_ca, Self::tls_ca_file))
    }

    /// Set the broker URL. Defaults to [`DEFAULT_URL`].
    #[must_use]
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = url.into();
        self
    }

    /// Encode events with this envelope. See [`AmqpConfig::envelope`].
    #[must_use]
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.envelope = envelope;
        self
    }

    /// Set the routing rule. Defaults to exchange `outbox`, routing key = event type.
    #[must_use]
    pub fn routing(mut self, routing: AmqpRouting) -> Self {
        self.routing = routing;
        self
    }

    /// Set the connect/send/confirm timeout. Defaults to 10 s.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Use this password instead of the URL's. See [`AmqpConfig::password`].
    #[must_use]
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Trust this CA certificate (PEM file) for `amqps://`. See [`AmqpConfig::tls_ca_file`].
    #[must_use]
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_ca_file = Some(path.into());
        self
    }

    /// Set the connection name. Defaults to `pgoutbox-relay`.
    #[must_use]
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// Check every setting.
    pub fn validate(&self) -> Result<()> {
        AMQPUri::from_str(&self.url)
            .map_err(|e| Error::config("url", format!("`{}`: {e}", redact_url(&self.url))))?;
        if self.timeout.is_zero() {
            return Err(Error::config("timeout", "must be greater than zero"));
        }
        if let Some(path) = self.tls_ca_file.as_deref().filter(|p| !p.is_file()) {
            return Err(Error::config(
                "tls_ca_file",
                format!("`{}` is not a readable file", path.display()),
            ));
        }
        self.routing.validate()
    }

    /// Validate and return the publisher; it connects on its first batch (or
    /// [`check`](pgoutbox_core::Publisher::check)), and again after any connection loss,
    /// so a relay can start while the broker is down.
    pub fn build(self) -> Result<AmqpPublisher> {
        self.validate()?;
        Ok(AmqpPublisher::new(self))
    }

    /// Validate and connect now, failing if the broker cannot be reached in time.
    pub async fn connect(self) -> Result<AmqpPublisher> {
        let publisher = self.build()?;
        publisher.connect().await?;
        Ok(publisher)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EnvOverrides;

    #[test]
    fn the_environment_wins_over_the_file() {
        let file: AmqpSettings =
            toml::from_str("exchange = \"file\"\ntimeout = \"2s\"\nconnection_name = \"f\"")
                .unwrap();
        let settings = file
            .with_vars([
                ("OUTBOX_AMQP_EXCHANGE", "env"),
                ("OUTBOX_AMQP_TIMEOUT_MS", ""),
            ])
            .unwrap();
        let c = AmqpConfig::from_settings(&settings).unwrap();
        assert_eq!(c.routing.exchange(), "env");
        assert_eq!(
            (c.timeout, c.connection_name.as_str()),
            (Duration::from_secs(2), "f")
        );
        let err = AmqpConfig::from_settings(&AmqpSettings {
            password_file: Some("/nonexistent/pw".into()),
            ..AmqpSettings::default()
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("OUTBOX_AMQP_PASSWORD_FILE"),
            "{err}"
        );
    }

    #[test]
    fn env_overrides_defaults() {
        let c = AmqpConfig::from_vars([
            ("OUTBOX_AMQP_URL", "amqp://u:secret@h:5673/v"),
            ("OUTBOX_AMQP_TIMEOUT_MS", "250"),
            ("OUTBOX_AMQP_EXCHANGE", "shop"),
        ])
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(250));
        assert_eq!(c.routing.exchange(), "shop");
        c.validate().unwrap();
        assert!(!format!("{c:?}").contains("secret"));
    }

    #[test]
    fn bad_values_are_named() {
        let err = AmqpConfig::from_vars([("OUTBOX_AMQP_TIMEOUT_MS", "x")]).unwrap_err();
        assert!(err.to_string().contains("OUTBOX_AMQP_TIMEOUT_MS"), "{err}");
        let err = AmqpConfig::new("http://nope").validate().unwrap_err();
        assert!(err.to_string().contains("url"), "{err}");
        assert!(matches!(&err, Error::Config(e) if e.key == "url"), "{err}");
        assert!(AmqpConfig::default()
            .timeout(Duration::ZERO)
            .validate()
            .is_err());
        assert!(AmqpConfig::default()
            .routing(AmqpRouting::new("a b"))
            .validate()
            .is_err());
    }
}
