//! Configuration of the [`NatsPublisher`]: defaults, environment, validation.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use async_nats::ServerAddr;
use pgoutbox_core::envelope::Envelope;
use pgoutbox_core::redact_url;
use pgoutbox_core::settings::{settings_and_envelope, HumanDuration, WithSetting};

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

pgoutbox_core::settings::env_settings! {
    /// NATS settings as a configuration file or the environment writes them, every
    /// one optional (unset: the default of [`NatsConfig`]). The `outbox` binary reads
    /// its `[broker.nats]` section into this, lays the environment over it
    /// ([`EnvOverrides::with_env`](crate::EnvOverrides::with_env)) and builds the
    /// config with [`NatsConfig::from_settings`].
    pub struct NatsSettings {
        /// [`NatsConfig::url`].
        #[env(ENV_URL = "OUTBOX_NATS_URL")]
        url: Option<String>,
        /// Prefix of the default [`SubjectRouting`].
        #[env(ENV_SUBJECT_PREFIX = "OUTBOX_NATS_SUBJECT_PREFIX")]
        subject_prefix: Option<String>,
        /// [`NatsConfig::timeout`], e.g. `"5s"`.
        #[env(ENV_TIMEOUT_MS = "OUTBOX_NATS_TIMEOUT_MS", millis)]
        timeout: Option<HumanDuration>,
        /// [`NatsConfig::max_in_flight`].
        #[env(ENV_MAX_IN_FLIGHT = "OUTBOX_NATS_MAX_IN_FLIGHT")]
        max_in_flight: Option<usize>,
        /// [`NatsConfig::client_name`].
        #[env(ENV_CLIENT_NAME = "OUTBOX_NATS_CLIENT_NAME")]
        client_name: Option<String>,
        /// User of [`NatsConfig::user_password`].
        #[env(ENV_USER = "OUTBOX_NATS_USER")]
        user: Option<String>,
        /// Password of [`NatsConfig::user_password`].
        #[env(ENV_PASSWORD = "OUTBOX_NATS_PASSWORD")]
        password: Option<String>,
        /// [`NatsConfig::token`].
        #[env(ENV_TOKEN = "OUTBOX_NATS_TOKEN")]
        token: Option<String>,
        /// The password, read from this file (a mounted secret).
        #[env(ENV_PASSWORD_FILE = "OUTBOX_NATS_PASSWORD_FILE")]
        password_file: Option<PathBuf>,
        /// The token, read from this file (a mounted secret).
        #[env(ENV_TOKEN_FILE = "OUTBOX_NATS_TOKEN_FILE")]
        token_file: Option<PathBuf>,
        /// [`NatsConfig::tls_required`], `true` or `false`.
        #[env(ENV_TLS_REQUIRED = "OUTBOX_NATS_TLS_REQUIRED")]
        tls_required: Option<bool>,
        /// [`NatsConfig::tls_ca_file`].
        #[env(ENV_TLS_CA = "OUTBOX_NATS_TLS_CA")]
        tls_ca: Option<PathBuf>,
        /// Certificate of [`NatsConfig::tls_client_cert`].
        #[env(ENV_TLS_CERT = "OUTBOX_NATS_TLS_CERT")]
        tls_cert: Option<PathBuf>,
        /// Key of [`NatsConfig::tls_client_cert`].
        #[env(ENV_TLS_KEY = "OUTBOX_NATS_TLS_KEY")]
        tls_key: Option<PathBuf>,
        /// [`NatsConfig::credentials_file`].
        #[env(ENV_CREDS = "OUTBOX_NATS_CREDS")]
        creds: Option<PathBuf>,
        /// [`NatsConfig::nkey_seed_file`].
        #[env(ENV_NKEY_FILE = "OUTBOX_NATS_NKEY_FILE")]
        nkey_file: Option<PathBuf>,
        /// A JetStream stream to create (or update) over the subjects before
        /// publishing ([`NatsPublisher::ensure_stream`]); the `outbox` binary's
        /// `relay` and `migrate` do. No environment variable: a deployment decision.
        ensure_stream: Option<String>,
    }
    type Error = Error;
}

// Not derived: the password and the token are hidden. Destructured so that a new
// field (a secret, perhaps) is shown or hidden on purpose.
impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            url,
            routing,
            timeout,
            max_in_flight,
            client_name,
            user_password,
            token,
            tls_required,
            tls_ca_file,
            tls_client_cert,
            credentials_file,
            nkey_seed_file,
            envelope,
        } = self;
        f.debug_struct("NatsConfig")
            .field("url", &redact_url(url))
            .field("routing", routing)
            .field("timeout", timeout)
            .field("max_in_flight", max_in_flight)
            .field("client_name", client_name)
            .field("user", &user_password.as_ref().map(|(user, _)| user))
            .field("token", &token.as_ref().map(|_| "<redacted>"))
            .field("tls_required", tls_required)
            .field("tls_ca_file", tls_ca_file)
            .field("tls_client_cert", tls_client_cert)
            .field("credentials_file", credentials_file)
            .field("nkey_seed_file", nkey_seed_file)
            .field("envelope", envelope)
            .finish()
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self::new(DEFAULT_URL)
    }
}

/// `from_settings` sets what the settings set, one line each.
impl WithSetting for NatsConfig {}

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

    /// Defaults overridden by the environment ([`NatsSettings`]'s
    /// [`EnvOverrides::with`](crate::EnvOverrides::with) lists the `OUTBOX_NATS_*`
    /// variables), and the envelope: `OUTBOX_ENVELOPE`, `OUTBOX_CLOUDEVENTS_*`
    /// ([`Envelope::from_lookup`]). Unset or empty variables keep the default;
    /// unparsable ones are an error.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars())
    }

    /// Like [`NatsConfig::from_env`], from the given variables.
    pub fn from_vars<S: Into<String>>(vars: impl IntoIterator<Item = (S, S)>) -> Result<Self> {
        let (settings, envelope) = settings_and_envelope::<NatsSettings>(vars)?;
        Ok(Self::from_settings(&settings)?.envelope(envelope))
    }

    /// Defaults overridden by `settings` (a configuration file's section, the
    /// environment laid over it). Secrets given as files are read here; a
    /// setting that needs its partner (user and password, certificate and key)
    /// is refused alone.
    pub fn from_settings(settings: &NatsSettings) -> Result<Self> {
        let s = settings;
        let mut config = Self::default()
            .with_setting(&s.url, Self::url)
            .with_setting(&s.subject_prefix, |c, prefix| {
                c.routing(SubjectRouting::new(prefix))
            })
            .with_setting(&s.timeout, |c, timeout| c.timeout(timeout.into()))
            .with_setting(&s.max_in_flight, Self::max_in_flight)
            .with_setting(&s.client_name, Self::client_name)
            .with_setting(&s.tls_required, Self::tls_required)
            .with_setting(&s.tls_ca, Self::tls_ca_file)
            .with_setting(&s.creds, Self::credentials_file)
            .with_setting(&s.nkey_file, Self::nkey_seed_file);
        let password = value_or_file(
            (s.password.as_ref(), "password", ENV_PASSWORD),
            (
                s.password_file.as_deref(),
                "password_file",
                ENV_PASSWORD_FILE,
            ),
        )?;
        config.user_password = both_or_neither(
            (s.user.clone(), password),
            format!("user ({ENV_USER}) and password ({ENV_PASSWORD})"),
        )?;
        config.token = value_or_file(
            (s.token.as_ref(), "token", ENV_TOKEN),
            (s.token_file.as_deref(), "token_file", ENV_TOKEN_FILE),
        )?;
        config.tls_client_cert = both_or_neither(
            (s.tls_cert.clone(), s.tls_key.clone()),
            format!("tls_cert ({ENV_TLS_CERT}) and tls_key ({ENV_TLS_KEY})"),
        )?;
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

/// Two settings that only work together (user and password, certificate and key):
/// both, or neither; `names` names them in the error.
fn both_or_neither<A, B>(pair: (Option<A>, Option<B>), names: String) -> Result<Option<(A, B)>> {
    match pair {
        (Some(a), Some(b)) => Ok(Some((a, b))),
        (None, None) => Ok(None),
        _ => Err(Error::config(names, "set both or neither")),
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
    use crate::EnvOverrides;

    #[test]
    fn env_overrides_defaults() {
        let c = NatsConfig::from_vars([
            ("OUTBOX_NATS_URL", "nats://a:1,nats://b:2"),
            ("OUTBOX_NATS_TIMEOUT_MS", "250"),
            ("OUTBOX_NATS_SUBJECT_PREFIX", "shop"),
        ])
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
            .with_vars([
                ("OUTBOX_NATS_URL", "nats://env:4222"),
                ("OUTBOX_NATS_CLIENT_NAME", " "),
            ])
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
        let refused =
            |vars: [(&str, &str); 2]| NatsConfig::from_vars(vars).unwrap_err().to_string();
        let both = refused([("OUTBOX_NATS_TOKEN", "x"), ("OUTBOX_NATS_TOKEN_FILE", "x")]);
        assert!(
            both.contains("OUTBOX_NATS_TOKEN)")
                && both.contains("OUTBOX_NATS_TOKEN_FILE")
                && both.contains("set one, not both"),
            "{both}"
        );
        let missing = refused([
            ("OUTBOX_NATS_USER", "u"),
            ("OUTBOX_NATS_PASSWORD_FILE", "/nonexistent/password"),
        ]);
        assert!(
            missing.contains("OUTBOX_NATS_PASSWORD_FILE")
                && missing.contains("/nonexistent/password"),
            "{missing}"
        );
    }

    #[test]
    fn bad_values_are_named() {
        let err = NatsConfig::from_vars([("OUTBOX_NATS_TIMEOUT_MS", "soon")]).unwrap_err();
        assert!(err.to_string().contains("OUTBOX_NATS_TIMEOUT_MS"), "{err}");
        assert!(
            matches!(&err, Error::Config(e) if e.key == "OUTBOX_NATS_TIMEOUT_MS"),
            "{err}"
        );
        let err = NatsConfig::from_vars([("OUTBOX_NATS_USER", "u")]).unwrap_err();
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
