//! Configuration of the [`NatsPublisher`]: defaults, environment, validation.

use std::str::FromStr;
use std::time::Duration;

use async_nats::ServerAddr;

use crate::error::{Error, Result};
use crate::publisher::NatsPublisher;
use crate::routing::SubjectRouting;

/// Default server URL.
pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

/// How to reach NATS and where to publish.
///
/// ```no_run
/// # async fn demo() -> Result<(), pgoutbox_nats::Error> {
/// use std::time::Duration;
/// use pgoutbox_nats::{NatsConfig, SubjectRouting};
///
/// let publisher = NatsConfig::new("nats://127.0.0.1:4222")
///     .routing(SubjectRouting::new("shop").aggregate_type("payment", "payments.events"))
///     .timeout(Duration::from_secs(5))
///     .build()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated. Defaults to [`DEFAULT_URL`].
    pub url: String,
    /// Subject routing rule. Defaults to `outbox.<event_type>`.
    pub routing: SubjectRouting,
    /// Longest wait for a connection, for sending a message and for its PubAck.
    /// A message not acknowledged in time is a retryable failure. Defaults to 10 s.
    pub timeout: Duration,
    /// Most messages awaiting their PubAck at once; more wait. Defaults to 1024.
    pub max_in_flight: usize,
    /// Client name shown by the server. Defaults to `pgoutbox-relay`.
    pub client_name: String,
    /// User and password. Defaults to none.
    pub user_password: Option<(String, String)>,
    /// Authentication token. Defaults to none.
    pub token: Option<String>,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &self.url)
            .field("routing", &self.routing)
            .field("timeout", &self.timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("client_name", &self.client_name)
            .field("user", &self.user_password.as_ref().map(|(u, _)| u))
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self::new(DEFAULT_URL)
    }
}

impl NatsConfig {
    /// Defaults, with this server URL.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            routing: SubjectRouting::default(),
            timeout: Duration::from_secs(10),
            max_in_flight: 1024,
            client_name: "pgoutbox-relay".into(),
            user_password: None,
            token: None,
        }
    }

    /// Defaults overridden by the environment:
    ///
    /// | variable | setting |
    /// |---|---|
    /// | `OUTBOX_NATS_URL` | [`NatsConfig::url`] |
    /// | `OUTBOX_NATS_SUBJECT_PREFIX` | prefix of the default [`SubjectRouting`] |
    /// | `OUTBOX_NATS_TIMEOUT_MS` | [`NatsConfig::timeout`], milliseconds |
    /// | `OUTBOX_NATS_MAX_IN_FLIGHT` | [`NatsConfig::max_in_flight`] |
    /// | `OUTBOX_NATS_CLIENT_NAME` | [`NatsConfig::client_name`] |
    /// | `OUTBOX_NATS_USER`, `OUTBOX_NATS_PASSWORD` | [`NatsConfig::user_password`] |
    /// | `OUTBOX_NATS_TOKEN` | [`NatsConfig::token`] |
    ///
    /// Unset or empty variables keep the default; unparsable ones are an error.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`NatsConfig::from_env`], from the given variables (e.g. a config file's
    /// values overlaid by the environment).
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let vars: std::collections::HashMap<String, String> = vars.into_iter().collect();
        Self::from_lookup(|name| vars.get(name).cloned())
    }

    pub(crate) fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let mut config = Self::default();
        if let Some(url) = var("OUTBOX_NATS_URL") {
            config.url = url;
        }
        if let Some(prefix) = var("OUTBOX_NATS_SUBJECT_PREFIX") {
            config.routing = SubjectRouting::new(prefix);
        }
        if let Some(ms) = var("OUTBOX_NATS_TIMEOUT_MS") {
            config.timeout = Duration::from_millis(parse("OUTBOX_NATS_TIMEOUT_MS", &ms)?);
        }
        if let Some(n) = var("OUTBOX_NATS_MAX_IN_FLIGHT") {
            config.max_in_flight = parse("OUTBOX_NATS_MAX_IN_FLIGHT", &n)?;
        }
        if let Some(name) = var("OUTBOX_NATS_CLIENT_NAME") {
            config.client_name = name;
        }
        match (var("OUTBOX_NATS_USER"), var("OUTBOX_NATS_PASSWORD")) {
            (Some(user), Some(password)) => config.user_password = Some((user, password)),
            (None, None) => {}
            _ => {
                return Err(Error::config(
                    "OUTBOX_NATS_USER/OUTBOX_NATS_PASSWORD",
                    "set both or neither",
                ))
            }
        }
        config.token = var("OUTBOX_NATS_TOKEN");
        Ok(config)
    }

    /// Set the server URL(s), comma-separated. Defaults to [`DEFAULT_URL`].
    #[must_use]
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = url.into();
        self
    }

    /// Set the routing rule. Defaults to `outbox.<event_type>`.
    #[must_use]
    pub fn routing(mut self, routing: SubjectRouting) -> Self {
        self.routing = routing;
        self
    }

    /// Set the connect/send/PubAck timeout. Defaults to 10 s.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set the most messages awaiting a PubAck at once. Defaults to 1024.
    #[must_use]
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Set the client name. Defaults to `pgoutbox-relay`.
    #[must_use]
    pub fn client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = name.into();
        self
    }

    /// Authenticate with user and password. Defaults to none.
    #[must_use]
    pub fn user_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user_password = Some((user.into(), password.into()));
        self
    }

    /// Authenticate with a token. Defaults to none.
    #[must_use]
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Check every setting; returns the parsed server addresses.
    pub fn validate(&self) -> Result<Vec<ServerAddr>> {
        let servers = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                ServerAddr::from_str(s).map_err(|e| Error::config("url", format!("`{s}`: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        if servers.is_empty() {
            return Err(Error::config("url", "no server URL given"));
        }
        if self.timeout.is_zero() {
            return Err(Error::config("timeout", "must be greater than zero"));
        }
        if self.max_in_flight == 0 {
            return Err(Error::config("max_in_flight", "must be at least 1"));
        }
        self.routing.validate()?;
        Ok(servers)
    }

    /// Validate, then start connecting and return the publisher at once.
    ///
    /// The connection is made (and re-made after any loss) in the background, so a
    /// relay can start while NATS is down: publishes then fail as retryable until it is
    /// back. Use [`NatsPublisher::check`](pgoutbox_core::Publisher::check) or
    /// [`NatsConfig::connect`] to wait for a connection.
    pub async fn build(self) -> Result<NatsPublisher> {
        NatsPublisher::start(self, false).await
    }

    /// Validate and connect, failing if the server cannot be reached within the timeout.
    pub async fn connect(self) -> Result<NatsPublisher> {
        NatsPublisher::start(self, true).await
    }
}

fn parse<T: FromStr>(var: &str, value: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    value
        .trim()
        .parse()
        .map_err(|e| Error::config(var, format!("`{value}`: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_defaults() {
        let c = NatsConfig::from_lookup(|name| match name {
            "OUTBOX_NATS_URL" => Some("nats://a:1,nats://b:2".into()),
            "OUTBOX_NATS_TIMEOUT_MS" => Some("250".into()),
            "OUTBOX_NATS_SUBJECT_PREFIX" => Some("shop".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(250));
        assert_eq!(c.routing.prefix(), "shop");
        assert_eq!(c.validate().unwrap().len(), 2);
    }

    #[test]
    fn bad_values_are_named() {
        let err = NatsConfig::from_lookup(|name| {
            (name == "OUTBOX_NATS_TIMEOUT_MS").then(|| "soon".to_string())
        })
        .unwrap_err();
        assert!(err.to_string().contains("OUTBOX_NATS_TIMEOUT_MS"), "{err}");
        let err = NatsConfig::from_lookup(|name| (name == "OUTBOX_NATS_USER").then(|| "u".into()))
            .unwrap_err();
        assert!(err.to_string().contains("OUTBOX_NATS_PASSWORD"), "{err}");
        assert!(NatsConfig::new("nats://host:notaport").validate().is_err());
        assert!(NatsConfig::new(" , ").validate().is_err());
        assert!(NatsConfig::default()
            .timeout(Duration::ZERO)
            .validate()
            .is_err());
        assert!(NatsConfig::default().max_in_flight(0).validate().is_err());
        assert!(NatsConfig::default()
            .routing(SubjectRouting::new("bad prefix"))
            .validate()
            .is_err());
    }
}
