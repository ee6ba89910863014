//! Configuration of the [`NatsPublisher`]: defaults, environment, validation.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use async_nats::ServerAddr;
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::redact_url;
use pgoutbox_core::settings::{settings_and_envelope, EnvOverrides, HumanDuration, Vars};
use serde::Deserialize;

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

/// NATS settings as a configuration file or the environment writes them, every
/// one optional (unset: the default of [`NatsConfig`]). The `outbox` binary reads
/// its `[broker.nats]` section into this, lays the environment over it
/// ([`EnvOverrides::with_env`]) and builds the config with
/// [`NatsConfig::from_settings`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct NatsSettings {
    /// [`NatsConfig::url`].
    pub url: Option<String>,
    /// Prefix of the default [`SubjectRouting`].
    pub subject_prefix: Option<String>,
    /// [`NatsConfig::timeout`], e.g. `"5s"`.
    pub timeout: Option<HumanDuration>,
    /// [`NatsConfig::max_in_flight`].
    pub max_in_flight: Option<usize>,
    /// [`NatsConfig::client_name`].
    pub client_name: Option<String>,
    /// User of [`NatsConfig::user_password`].
    pub user: Option<String>,
    /// Password of [`NatsConfig::user_password`].
    pub password: Option<String>,
    /// [`NatsConfig::token`].
    pub token: Option<String>,
    /// The password, read from this file (a mounted secret).
    pub password_file: Option<PathBuf>,
    /// The token, read from this file (a mounted secret).
    pub token_file: Option<PathBuf>,
    /// [`NatsConfig::tls_required`].
    pub tls_required: Option<bool>,
    /// [`NatsConfig::tls_ca_file`].
    pub tls_ca: Option<PathBuf>,
    /// Certificate of [`NatsConfig::tls_client_cert`].
    pub tls_cert: Option<PathBuf>,
    /// Key of [`NatsConfig::tls_client_cert`].
    pub tls_key: Option<PathBuf>,
    /// [`NatsConfig::credentials_file`].
    pub creds: Option<PathBuf>,
    /// [`NatsConfig::nkey_seed_file`].
    pub nkey_file: Option<PathBuf>,
    /// A JetStream stream to create (or update) over the subjects before
    /// publishing ([`NatsPublisher::ensure_stream`]); the `outbox` binary's
    /// `relay` and `migrate` do. No environment variable: a deployment decision.
    pub ensure_stream: Option<String>,
}

impl EnvOverrides for NatsSettings {
    type Error = Error;

    /// These settings with `vars` laid over them: each variable that is set
    /// replaces its setting.
    ///
    /// | variable | setting |
    /// |---|---|
    /// | `OUTBOX_NATS_URL` | `url` |
    /// | `OUTBOX_NATS_SUBJECT_PREFIX` | `subject_prefix` |
    /// | `OUTBOX_NATS_TIMEOUT_MS` | `timeout`, in milliseconds |
    /// | `OUTBOX_NATS_MAX_IN_FLIGHT` | `max_in_flight` |
    /// | `OUTBOX_NATS_CLIENT_NAME` | `client_name` |
    /// | `OUTBOX_NATS_USER`, `OUTBOX_NATS_PASSWORD` | `user`, `password` |
    /// | `OUTBOX_NATS_TOKEN` | `token` |
    /// | `OUTBOX_NATS_PASSWORD_FILE`, `OUTBOX_NATS_TOKEN_FILE` | `password_file`, `token_file` |
    /// | `OUTBOX_NATS_TLS_REQUIRED` | `tls_required`, `true` or `false` |
    /// | `OUTBOX_NATS_TLS_CA` | `tls_ca` |
    /// | `OUTBOX_NATS_TLS_CERT`, `OUTBOX_NATS_TLS_KEY` | `tls_cert`, `tls_key` |
    /// | `OUTBOX_NATS_CREDS` | `creds` |
    /// | `OUTBOX_NATS_NKEY_FILE` | `nkey_file` |
    fn with(mut self, vars: &Vars) -> Result<Self> {
        self.url = vars.text(ENV_URL).or(self.url);
        self.subject_prefix = vars.text(ENV_SUBJECT_PREFIX).or(self.subject_prefix);
        self.timeout = vars.millis(ENV_TIMEOUT_MS)?.or(self.timeout);
        self.max_in_flight = vars.parse(ENV_MAX_IN_FLIGHT)?.or(self.max_in_flight);
        self.client_name = vars.text(ENV_CLIENT_NAME).or(self.client_name);
        self.user = vars.text(ENV_USER).or(self.user);
        self.password = vars.text(ENV_PASSWORD).or(self.password);
        self.token = vars.text(ENV_TOKEN).or(self.token);
        self.password_file = vars.path(ENV_PASSWORD_FILE).or(self.password_file);
        self.token_file = vars.path(ENV_TOKEN_FILE).or(self.token_file);
        self.tls_required = vars.parse(ENV_TLS_REQUIRED)?.or(self.tls_required);
        self.tls_ca = vars.path(ENV_TLS_CA).or(self.tls_ca);
        self.tls_cert = vars.path(ENV_TLS_CERT).or(self.tls_cert);
        self.tls_key = vars.path(ENV_TLS_KEY).or(self.tls_key);
        self.creds = vars.path(ENV_CREDS).or(self.creds);
        self.nkey_file = vars.path(ENV_NKEY_FILE).or(self.nkey_file);
        Ok(self)
    }
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

    /// Defaults overridden by the environment ([`NatsSettings`]'s [`EnvOverrides::with`] lists
    /// the `OUTBOX_NATS_*` variables), and the envelope: `OUTBOX_ENVELOPE`,
    /// `OUTBOX_CLOUDEVENTS_*` ([`Envelope::from_lookup`]). Unset or empty
    /// variables keep the default; unparsable ones are an error.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars())
    }

    /// Like [`NatsConfig::from_env`], from the given variables.
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let (settings, envelope) = settings_and_envelope::<NatsSettings>(vars, |e| {
            Error::config("envelope", e.to_string())
        })?;
        Ok(Self::from_settings(&settings)?.envelope(envelope))
    }

    /// Defaults overridden by `settings` (a configuration file's section, the
    /// environment laid over it). Secrets given as files are read here; a
    /// setting that needs its partner (user and password, certificate and key)
    /// is refused alone.
    pub fn from_settings(settings: &NatsSettings) -> Result<Self> {
        let s = settings;
        let mut config = Self::default();
        if let Some(url) = &s.url {
            config.url.clone_from(url);
        }
        if let Some(prefix) = &s.subject_prefix {
            config.routing = SubjectRouting::new(prefix.clone());
        }
        if let Some(timeout) = s.timeout {
            config.timeout = timeout.0;
        }
        if let Some(n) = s.max_in_flight {
            config.max_in_flight = n;
        }
        if let Some(name) = &s.client_name {
            config.client_name.clone_from(name);
        }
        let password = value_or_file(
            (s.password.as_ref(), "password", ENV_PASSWORD),
            (
                s.password_file.as_deref(),
                "password_file",
                ENV_PASSWORD_FILE,
            ),
        )?;
        config.user_password = match (s.user.clone(), password) {
            (Some(user), Some(password)) => Some((user, password)),
            (None, None) => None,
            _ => {
                return Err(Error::config(
                    format!("user ({ENV_USER}) and password ({ENV_PASSWORD})"),
                    "set both or neither",
                ))
            }
        };
        config.token = value_or_file(
            (s.token.as_ref(), "token", ENV_TOKEN),
            (s.token_file.as_deref(), "token_file", ENV_TOKEN_FILE),
        )?;
        if let Some(required) = s.tls_required {
            config.tls_required = required;
        }
        config.tls_ca_file.clone_from(&s.tls_ca);
        config.tls_client_cert = match (s.tls_cert.clone(), s.tls_key.clone()) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => {
                return Err(Error::config(
                    format!("tls_cert ({ENV_TLS_CERT}) and tls_key ({ENV_TLS_KEY})"),
                    "set both or neither",
                ))
            }
        };
        config.credentials_file.clone_from(&s.creds);
        config.nkey_seed_file.clone_from(&s.nkey_file);
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

/// A secret given as a setting or kept in a file (a mounted secret); setting
/// both is an error. Each side: the value, its key and its variable.
fn value_or_file(
    value: (Option<&String>, &str, &str),
    file: (Option<&Path>, &str, &str),
) -> Result<Option<String>> {
    match (value.0, file.0) {
        (Some(_), Some(_)) => Err(Error::config(
            format!("{} ({}) and {} ({})", value.1, value.2, file.1, file.2),
            "set one, not both",
        )),
        (Some(value), None) => Ok(Some(value.clone())),
        (None, Some(path)) => pgoutbox_core::read_secret_file(path)
            .map(Some)
            .map_err(|e| Error::config(format!("{} ({})", file.1, file.2), e.to_string())),
        (None, None) => Ok(None),
    }
}

/// The nkey seed in `path`, for [`NatsConfig::nkey_seed_file`].
pub(crate) fn read_nkey_seed(path: &Path) -> Result<String> {
    pgoutbox_core::read_secret_file(path)
        .map_err(|e| Error::config("nkey_seed_file", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn env_overrides_defaults() {
        let c = NatsConfig::from_vars(vars(&[
            ("OUTBOX_NATS_URL", "nats://a:1,nats://b:2"),
            ("OUTBOX_NATS_TIMEOUT_MS", "250"),
            ("OUTBOX_NATS_SUBJECT_PREFIX", "shop"),
        ]))
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(250));
        assert_eq!(c.routing.prefix(), "shop");
        assert_eq!(c.validate().unwrap().len(), 2);
    }

    #[test]
    fn the_environment_wins_over_the_file_and_blank_values_are_unset() {
        let file: NatsSettings = toml::from_str(
            r#"
            url = "nats://file:4222"
            timeout = "3s"
            client_name = "from-file"
            ensure_stream = "EVENTS"
            "#,
        )
        .unwrap();
        let settings = file
            .with_vars(vars(&[
                ("OUTBOX_NATS_URL", "nats://env:4222"),
                ("OUTBOX_NATS_CLIENT_NAME", " "),
            ]))
            .unwrap();
        let c = NatsConfig::from_settings(&settings).unwrap();
        assert_eq!(c.url, "nats://env:4222");
        assert_eq!(c.client_name, "from-file");
        assert_eq!(c.timeout, Duration::from_secs(3));
        assert_eq!(settings.ensure_stream.as_deref(), Some("EVENTS"));
        let err = toml::from_str::<NatsSettings>("urll = \"x\"").unwrap_err();
        assert!(err.to_string().contains("urll"), "{err}");
    }

    #[test]
    fn a_secret_comes_from_its_variable_or_its_file_never_both() {
        let both = NatsConfig::from_vars(vars(&[
            ("OUTBOX_NATS_TOKEN", "x"),
            ("OUTBOX_NATS_TOKEN_FILE", "x"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            both.contains("OUTBOX_NATS_TOKEN)")
                && both.contains("OUTBOX_NATS_TOKEN_FILE")
                && both.contains("set one, not both"),
            "{both}"
        );
        let missing = NatsConfig::from_vars(vars(&[
            ("OUTBOX_NATS_USER", "u"),
            ("OUTBOX_NATS_PASSWORD_FILE", "/nonexistent/password"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            missing.contains("OUTBOX_NATS_PASSWORD_FILE")
                && missing.contains("/nonexistent/password"),
            "{missing}"
        );
    }

    #[test]
    fn bad_values_are_named() {
        let err = NatsConfig::from_vars(vars(&[("OUTBOX_NATS_TIMEOUT_MS", "soon")])).unwrap_err();
        assert!(err.to_string().contains("OUTBOX_NATS_TIMEOUT_MS"), "{err}");
        let err = NatsConfig::from_vars(vars(&[("OUTBOX_NATS_USER", "u")])).unwrap_err();
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
