//! Configuration of the [`NatsPublisher`]: defaults, environment, validation.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use async_nats::ServerAddr;
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::redact_url;

use crate::error::{Error, Result};
use crate::publisher::NatsPublisher;
use crate::routing::SubjectRouting;

/// Environment variable `OUTBOX_NATS_URL` (see [`NatsConfig::from_env`]).
pub const ENV_URL: &str = "OUTBOX_NATS_URL";
/// Environment variable `OUTBOX_NATS_SUBJECT_PREFIX` (see [`NatsConfig::from_env`]).
pub const ENV_SUBJECT_PREFIX: &str = "OUTBOX_NATS_SUBJECT_PREFIX";
/// Environment variable `OUTBOX_NATS_TIMEOUT_MS` (see [`NatsConfig::from_env`]).
pub const ENV_TIMEOUT_MS: &str = "OUTBOX_NATS_TIMEOUT_MS";
/// Environment variable `OUTBOX_NATS_MAX_IN_FLIGHT` (see [`NatsConfig::from_env`]).
pub const ENV_MAX_IN_FLIGHT: &str = "OUTBOX_NATS_MAX_IN_FLIGHT";
/// Environment variable `OUTBOX_NATS_CLIENT_NAME` (see [`NatsConfig::from_env`]).
pub const ENV_CLIENT_NAME: &str = "OUTBOX_NATS_CLIENT_NAME";
/// Environment variable `OUTBOX_NATS_USER` (see [`NatsConfig::from_env`]).
pub const ENV_USER: &str = "OUTBOX_NATS_USER";
/// Environment variable `OUTBOX_NATS_PASSWORD` (see [`NatsConfig::from_env`]).
pub const ENV_PASSWORD: &str = "OUTBOX_NATS_PASSWORD";
/// Environment variable `OUTBOX_NATS_TOKEN` (see [`NatsConfig::from_env`]).
pub const ENV_TOKEN: &str = "OUTBOX_NATS_TOKEN";
/// Environment variable `OUTBOX_NATS_PASSWORD_FILE` (see [`NatsConfig::from_env`]).
pub const ENV_PASSWORD_FILE: &str = "OUTBOX_NATS_PASSWORD_FILE";
/// Environment variable `OUTBOX_NATS_TOKEN_FILE` (see [`NatsConfig::from_env`]).
pub const ENV_TOKEN_FILE: &str = "OUTBOX_NATS_TOKEN_FILE";
/// Environment variable `OUTBOX_NATS_TLS_REQUIRED` (see [`NatsConfig::from_env`]).
pub const ENV_TLS_REQUIRED: &str = "OUTBOX_NATS_TLS_REQUIRED";
/// Environment variable `OUTBOX_NATS_TLS_CA` (see [`NatsConfig::from_env`]).
pub const ENV_TLS_CA: &str = "OUTBOX_NATS_TLS_CA";
/// Environment variable `OUTBOX_NATS_TLS_CERT` (see [`NatsConfig::from_env`]).
pub const ENV_TLS_CERT: &str = "OUTBOX_NATS_TLS_CERT";
/// Environment variable `OUTBOX_NATS_TLS_KEY` (see [`NatsConfig::from_env`]).
pub const ENV_TLS_KEY: &str = "OUTBOX_NATS_TLS_KEY";
/// Environment variable `OUTBOX_NATS_CREDS` (see [`NatsConfig::from_env`]).
pub const ENV_CREDS: &str = "OUTBOX_NATS_CREDS";
/// Environment variable `OUTBOX_NATS_NKEY_FILE` (see [`NatsConfig::from_env`]).
pub const ENV_NKEY_FILE: &str = "OUTBOX_NATS_NKEY_FILE";

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
#[non_exhaustive]
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
    /// Refuse a connection without TLS (a `tls://` URL does too). Defaults to
    /// `false`: TLS when the URL or the server asks for it.
    pub tls_required: bool,
    /// A CA certificate file (PEM) to trust besides the system's roots, for a server
    /// certificate of your own CA. Defaults to none.
    pub tls_ca_file: Option<PathBuf>,
    /// A client certificate and its key (PEM files), for servers that verify
    /// clients (mutual TLS). Defaults to none.
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
    /// A NATS credentials file (user JWT and nkey seed, `.creds`), for servers in
    /// operator/JWT mode. Defaults to none.
    pub credentials_file: Option<PathBuf>,
    /// A file holding a user nkey seed (`SU...`), for servers with nkey users.
    /// Defaults to none.
    pub nkey_seed_file: Option<PathBuf>,
    /// How events become messages: the outbox envelope (default) or CloudEvents.
    pub envelope: Envelope,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact_url(&self.url))
            .field("routing", &self.routing)
            .field("timeout", &self.timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("client_name", &self.client_name)
            .field("user", &self.user_password.as_ref().map(|(u, _)| u))
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls_required", &self.tls_required)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_client_cert", &self.tls_client_cert)
            .field("credentials_file", &self.credentials_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("envelope", &self.envelope)
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
            tls_required: false,
            tls_ca_file: None,
            tls_client_cert: None,
            credentials_file: None,
            nkey_seed_file: None,
            envelope: Envelope::default(),
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
    /// | `OUTBOX_NATS_PASSWORD_FILE`, `OUTBOX_NATS_TOKEN_FILE` | the password or token, read from a file (a mounted secret) |
    /// | `OUTBOX_NATS_TLS_REQUIRED` | [`NatsConfig::tls_required`], `true` or `false` |
    /// | `OUTBOX_NATS_TLS_CA` | [`NatsConfig::tls_ca_file`] |
    /// | `OUTBOX_NATS_TLS_CERT`, `OUTBOX_NATS_TLS_KEY` | [`NatsConfig::tls_client_cert`] |
    /// | `OUTBOX_NATS_CREDS` | [`NatsConfig::credentials_file`] |
    /// | `OUTBOX_NATS_NKEY_FILE` | [`NatsConfig::nkey_seed_file`] |
    /// | `OUTBOX_ENVELOPE`, `OUTBOX_CLOUDEVENTS_*` | [`NatsConfig::envelope`] ([`Envelope::from_lookup`]) |
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
        if let Some(url) = var(ENV_URL) {
            config.url = url;
        }
        if let Some(prefix) = var(ENV_SUBJECT_PREFIX) {
            config.routing = SubjectRouting::new(prefix);
        }
        if let Some(ms) = var(ENV_TIMEOUT_MS) {
            config.timeout = Duration::from_millis(parse(ENV_TIMEOUT_MS, &ms)?);
        }
        if let Some(n) = var(ENV_MAX_IN_FLIGHT) {
            config.max_in_flight = parse(ENV_MAX_IN_FLIGHT, &n)?;
        }
        if let Some(name) = var(ENV_CLIENT_NAME) {
            config.client_name = name;
        }
        let password = value_or_file(&var, ENV_PASSWORD, ENV_PASSWORD_FILE)?;
        match (var(ENV_USER), password) {
            (Some(user), Some(password)) => config.user_password = Some((user, password)),
            (None, None) => {}
            _ => {
                return Err(Error::config(
                    "OUTBOX_NATS_USER/OUTBOX_NATS_PASSWORD",
                    "set both or neither",
                ))
            }
        }
        config.token = value_or_file(&var, ENV_TOKEN, ENV_TOKEN_FILE)?;
        if let Some(flag) = var(ENV_TLS_REQUIRED) {
            config.tls_required = parse(ENV_TLS_REQUIRED, &flag)?;
        }
        config.tls_ca_file = var(ENV_TLS_CA).map(PathBuf::from);
        config.tls_client_cert = match (var(ENV_TLS_CERT), var(ENV_TLS_KEY)) {
            (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
            (None, None) => None,
            _ => {
                return Err(Error::config(
                    "OUTBOX_NATS_TLS_CERT/OUTBOX_NATS_TLS_KEY",
                    "set both or neither",
                ))
            }
        };
        config.credentials_file = var(ENV_CREDS).map(PathBuf::from);
        config.nkey_seed_file = var(ENV_NKEY_FILE).map(PathBuf::from);
        config.envelope =
            Envelope::from_lookup(var).map_err(|e| Error::config("envelope", e.to_string()))?;
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

    /// Refuse a connection without TLS. See [`NatsConfig::tls_required`].
    #[must_use]
    pub fn tls_required(mut self, required: bool) -> Self {
        self.tls_required = required;
        self
    }

    /// Trust this CA certificate (PEM file). See [`NatsConfig::tls_ca_file`].
    #[must_use]
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_ca_file = Some(path.into());
        self
    }

    /// Present this client certificate and key (PEM files).
    #[must_use]
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls_client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Authenticate with a NATS credentials file. See [`NatsConfig::credentials_file`].
    #[must_use]
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.credentials_file = Some(path.into());
        self
    }

    /// Encode events with this envelope. See [`NatsConfig::envelope`].
    #[must_use]
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.envelope = envelope;
        self
    }

    /// Authenticate with the nkey seed in this file. See [`NatsConfig::nkey_seed_file`].
    #[must_use]
    pub fn nkey_seed_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.nkey_seed_file = Some(path.into());
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
                ServerAddr::from_str(s)
                    .map_err(|e| Error::config("url", format!("`{}`: {e}", redact_url(s))))
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
        let mut files = vec![
            ("tls_ca_file", self.tls_ca_file.as_deref()),
            ("credentials_file", self.credentials_file.as_deref()),
            ("nkey_seed_file", self.nkey_seed_file.as_deref()),
        ];
        if let Some((cert, key)) = &self.tls_client_cert {
            files.push(("tls_client_cert", Some(cert.as_path())));
            files.push(("tls_client_cert", Some(key.as_path())));
        }
        for (field, path) in files {
            if let Some(path) = path.filter(|p| !p.is_file()) {
                return Err(Error::config(
                    field,
                    format!("`{}` is not a readable file", path.display()),
                ));
            }
        }
        let methods = [
            self.user_password.is_some(),
            self.token.is_some(),
            self.credentials_file.is_some(),
            self.nkey_seed_file.is_some(),
        ];
        if methods.iter().filter(|set| **set).count() > 1 {
            return Err(Error::config(
                "authentication",
                "set one of user/password, token, credentials file, nkey seed file",
            ));
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

/// A secret given in the variable `name` itself or kept in the file the variable
/// `file_name` names (a mounted secret); setting both is an error.
fn value_or_file(
    var: &impl Fn(&str) -> Option<String>,
    name: &str,
    file_name: &str,
) -> Result<Option<String>> {
    match (var(name), var(file_name)) {
        (Some(_), Some(_)) => Err(Error::config(
            format!("{name}/{file_name}"),
            "set one, not both",
        )),
        (Some(value), None) => Ok(Some(value)),
        (None, Some(path)) => pgoutbox_core::read_secret_file(Path::new(&path))
            .map(Some)
            .map_err(|e| Error::config(file_name, e.to_string())),
        (None, None) => Ok(None),
    }
}

/// The nkey seed in `path`, for [`NatsConfig::nkey_seed_file`].
pub(crate) fn read_nkey_seed(path: &Path) -> Result<String> {
    pgoutbox_core::read_secret_file(path)
        .map_err(|e| Error::config("nkey_seed_file", e.to_string()))
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
    fn a_secret_comes_from_its_variable_or_its_file_never_both() {
        let both = NatsConfig::from_lookup(|name| match name {
            "OUTBOX_NATS_TOKEN" | "OUTBOX_NATS_TOKEN_FILE" => Some("x".into()),
            _ => None,
        })
        .unwrap_err();
        assert!(
            both.to_string()
                .contains("OUTBOX_NATS_TOKEN/OUTBOX_NATS_TOKEN_FILE: set one, not both"),
            "{both}"
        );
        let missing = NatsConfig::from_lookup(|name| match name {
            "OUTBOX_NATS_USER" => Some("u".into()),
            "OUTBOX_NATS_PASSWORD_FILE" => Some("/nonexistent/password".into()),
            _ => None,
        })
        .unwrap_err();
        assert!(
            missing.to_string().contains("OUTBOX_NATS_PASSWORD_FILE")
                && missing.to_string().contains("/nonexistent/password"),
            "{missing}"
        );
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
