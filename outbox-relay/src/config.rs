//! The configuration: a TOML file, overridden by `OUTBOX_*` environment variables,
//! validated into the settings the commands use.
//!
//! Unknown keys are errors, so a misspelt setting never silently keeps its default.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pgoutbox_core::envelope::{self, Envelope};
use pgoutbox_core::settings::Vars;
use pgoutbox_core::{RelayConfig, RetryPolicy};
use pgoutbox_postgres::{AfterDeadLetter, Ident, Retention, StoreConfig, Tables, Wakeup};
use serde::{Deserialize, Deserializer};

use crate::failure::Failure;

/// A duration written like `100ms`, `30s`, `5m`, `2h` or `7d`.
pub(crate) use pgoutbox_core::settings::HumanDuration as Dur;

/// Parse `10m`, `2h`, `1h 30m`, `500ms`; `0` is zero.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    text.parse::<Dur>().map(Duration::from)
}

/// What happens to published rows: `"delete"`, or a duration to keep them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PublishedRetention(pub(crate) Retention);

impl PublishedRetention {
    fn parse(text: &str) -> Result<Self, String> {
        if text.trim() == "delete" {
            return Ok(Self(Retention::Delete));
        }
        parse_duration(text)
            .map(|d| Self(Retention::Keep(d)))
            .map_err(|_| format!("invalid retention `{text}`: expected \"delete\" or a duration to keep published rows, e.g. \"7d\""))
    }
}

impl<'de> Deserialize<'de> for PublishedRetention {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A section of the file (or the whole file), each key written once with its type
/// and its default (`Default::default()` when none is given): the struct (a missing
/// key takes its default, an unknown key is an error) and its `Default`.
macro_rules! section {
    (
        $(#[$attr:meta])*
        $name:ident {
            $(
                $(#[$key_attr:meta])*
                $key:ident: $type:ty $(= $default:expr)?,
            )*
        }
    ) => {
        $(#[$attr])*
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub(crate) struct $name {
            $(
                $(#[$key_attr])*
                pub(crate) $key: $type,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    $($key: section!(@default $($default)?),)*
                }
            }
        }
    };
    (@default) => {
        Default::default()
    };
    (@default $default:expr) => {
        $default
    };
}

section! {
    /// The whole file. Every section and key is optional.
    FileConfig {
        database: DatabaseSection,
        /// `[tables]`: the one outbox, when no `[[outbox]]` lists several.
        tables: Option<TablesSection>,
        /// `[[outbox]]`: several outboxes relayed by one process.
        #[serde(rename = "outbox")]
        outboxes: Vec<OutboxSection>,
        /// `[tenants]`: every schema matching a pattern, found while the relay runs.
        tenants: Option<TenantsSection>,
        relay: RelaySection,
        /// `[retry]`: the core's own type.
        retry: RetryPolicy,
        retention: RetentionSection,
        http: HttpSection,
        console: ConsoleSection,
        broker: BrokerSection,
        routing: RoutingSection,
        envelope: EnvelopeSection,
        wal: WalSection,
    }
}

/// One `[[outbox]]` entry: an outbox of a process that relays several.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OutboxSection {
    /// Its name in metrics, logs and `--outbox`; default `schema.events_table`.
    pub(crate) name: Option<String>,
    pub(crate) schema: String,
    pub(crate) events_table: Option<String>,
    pub(crate) inbox_table: Option<String>,
    /// Another database; default `database.url`. Its outboxes share a pool of
    /// `database.max_connections` of their own.
    pub(crate) database_url: Option<String>,
    /// This outbox's own limits; default `[relay]`'s.
    pub(crate) batch_size: Option<usize>,
    pub(crate) workers: Option<usize>,
}

/// `[tenants]`: relay every schema of the database whose name matches `schemas`
/// (SQL `LIKE`) and holds the events table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TenantsSection {
    pub(crate) schemas: String,
    pub(crate) events_table: Option<String>,
    /// How often to look for new and dropped schemas.
    #[serde(default = "default_discovery_interval")]
    pub(crate) interval: Dur,
    /// Each tenant's limits; default `[relay]`'s.
    pub(crate) batch_size: Option<usize>,
    pub(crate) workers: Option<usize>,
}

fn default_discovery_interval() -> Dur {
    Dur::secs(30)
}

/// An outbox of a process that relays several, validated.
#[derive(Debug, Clone)]
pub(crate) struct OutboxTarget {
    pub(crate) name: String,
    pub(crate) tables: Tables,
    /// `None`: the `[database]` one.
    pub(crate) database_url: Option<String>,
    pub(crate) relay: RelayConfig,
}

/// `[tenants]`, validated.
#[derive(Debug, Clone)]
pub(crate) struct TenantsSettings {
    pub(crate) pattern: String,
    pub(crate) events_table: String,
    pub(crate) interval: Duration,
    pub(crate) relay: RelayConfig,
}

section! {
    /// `[wal]`: the table-less outbox, read from a logical replication slot.
    WalSection {
        enabled: bool,
        slot: Option<String>,
        publication: Option<String>,
        replication_url: Option<String>,
    }
}

/// The WAL outbox's settings, when `[wal] enabled`.
#[derive(Debug, Clone)]
pub(crate) struct WalSettings {
    /// `wal.slot`; `None`: the outbox's default in its database, known once
    /// connected (`wal::slot::resolve`).
    pub(crate) slot: Option<Ident>,
    pub(crate) publication: Ident,
    /// A direct URL for the replication connection; `None`: the database URL.
    pub(crate) replication_url: Option<String>,
}

section! {
    /// `[envelope]`: how the built-in brokers encode events (outbox or CloudEvents).
    EnvelopeSection {
        format: Option<String>,
        source: Option<String>,
        subject: Option<String>,
    }
}

section! {
    DatabaseSection {
        url: Option<String> = None,
        /// A file holding the password (a mounted secret); replaces one in the URL.
        password_file: Option<PathBuf> = None,
        max_connections: Option<u32> = None,
        connect_timeout: Dur = Dur::secs(10),
        claim_timeout: Dur = Dur::secs(120),
        pgbouncer: bool = false,
    }
}

section! {
    TablesSection {
        schema: String = "public".into(),
        events_table: String = "outbox_events".into(),
        inbox_table: String = "processed_events".into(),
    }
}

/// How an idle relay learns of new events: the name a file or variable gives to
/// one of the library's `Wakeup`s. Not that enum itself: its variants carry
/// values checked against other sections (`notify` needs `relay.notify_url`
/// behind PgBouncer) and a handle made at run time (the `SharedWakeup` of a
/// relay group), so `validate` builds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum WakeupMode {
    /// Poll fast right after traffic, back off to `poll_interval` when idle.
    Adaptive,
    /// Poll every `poll_interval`.
    Poll,
    /// LISTEN/NOTIFY (needs the trigger `outbox migrate` installs in this mode).
    Notify,
}

section! {
    /// `[relay]`; the defaults of the limits and timings are the core's.
    RelaySection {
        batch_size: usize = RelayConfig::default().batch_size,
        workers: usize = RelayConfig::default().workers,
        poll_interval: Dur = Dur(RelayConfig::default().poll_interval),
        publish_timeout: Dur = Dur(RelayConfig::default().publish_timeout),
        ordering: bool = true,
        after_dead_letter: AfterDeadLetter = AfterDeadLetter::Block,
        pending_refresh: Dur = Dur(RelayConfig::default().pending_refresh),
        error_backoff: Dur = Dur(RelayConfig::default().error_backoff),
        broker_probe_max: Dur = Dur(RelayConfig::default().broker_probe_max),
        event_type_labels: usize = RelayConfig::default().event_type_labels,
        shutdown_timeout: Dur = Dur::secs(30),
        wakeup: WakeupMode = WakeupMode::Adaptive,
        notify_url: Option<String> = None,
        synchronous_commit: bool = StoreConfig::default().synchronous_commit,
    }
}

section! {
    RetentionSection {
        published: PublishedRetention = PublishedRetention(Retention::Delete),
        cleanup_interval: Dur = Dur::secs(300),
        cleanup_batch_size: u32 = 1000,
        inbox: Option<Dur> = None,
    }
}

section! {
    HttpSection {
        listen: String = "127.0.0.1:9187".into(),
        stats_refresh: Dur = Dur::secs(15),
        check_timeout: Dur = Dur::secs(2),
        /// `/healthz` fails once a claim loop has not finished a cycle for this long.
        /// Default: `relay.publish_timeout + relay.poll_interval + 60s`.
        stuck_after: Option<Dur> = None,
    }
}

section! {
    /// `[console]`: the operator console on the `[http]` listener.
    ConsoleSection {
        enabled: bool = false,
        /// A file holding the token that actions (retry, purge) require; without
        /// it the console is read-only.
        token_file: Option<PathBuf> = None,
        /// How often the backlog and lag history (the last hour) is sampled.
        sample_interval: Dur = Dur::secs(5),
    }
}

/// `[console]` as the relay uses it.
#[derive(Debug, Clone)]
pub(crate) struct ConsoleSettings {
    pub(crate) enabled: bool,
    /// Read when the relay starts (a rotated token needs a restart).
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) sample_interval: Duration,
}

/// `[broker]`: the kind, and the `[broker.<kind>]` sections, each read by its
/// broker's factory (`broker::BrokerInput`), which lays the adapter's
/// `OUTBOX_<BROKER>_*` variables over it.
///
/// `broker::Brokers::check_sections` refuses a section of a broker this binary does
/// not know, so a misspelt one is still an error.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub(crate) struct BrokerSection {
    pub(crate) kind: String,
    #[serde(flatten)]
    pub(crate) sections: BTreeMap<String, toml::Value>,
    /// The file's text, for errors in a section that name the line.
    #[serde(skip)]
    pub(crate) text: Option<Arc<ConfigText>>,
}

impl Default for BrokerSection {
    fn default() -> Self {
        Self {
            kind: "stdout".into(),
            sections: BTreeMap::new(),
            text: None,
        }
    }
}

/// A configuration file as read: its path (for messages) and text.
#[derive(Debug)]
pub(crate) struct ConfigText {
    pub(crate) path: String,
    pub(crate) text: String,
}

section! {
    /// `[routing]`: destination by event type, then by aggregate type; an event's own
    /// `destination` wins over both.
    RoutingSection {
        event_type: BTreeMap<String, String>,
        aggregate_type: BTreeMap<String, String>,
    }
}

/// Connection settings.
#[derive(Debug, Clone)]
pub(crate) struct DatabaseSettings {
    pub(crate) url: String,
    /// Read when the command connects (once per process: a rotated secret needs a
    /// restart; the pool's later connections reuse what was read).
    pub(crate) password_file: Option<PathBuf>,
    pub(crate) max_connections: u32,
    pub(crate) connect_timeout: Duration,
    /// `idle_in_transaction_session_timeout` of relay connections; `None` leaves the server's.
    pub(crate) claim_timeout: Option<Duration>,
    pub(crate) pgbouncer: bool,
    /// Prepared statements kept per connection: each outbox has its own
    /// statements (schema-qualified), so several outboxes on one pool need more
    /// than sqlx's default of 100, or they evict each other's and PostgreSQL
    /// parses and plans them again on every claim.
    pub(crate) statement_cache: usize,
}

/// Retention as the commands use it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetentionSettings {
    pub(crate) published: Retention,
    pub(crate) cleanup_interval: Duration,
    pub(crate) cleanup_batch_size: u32,
    pub(crate) inbox: Option<Duration>,
}

/// `[http]` as the commands use it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HttpSettings {
    /// `None`: no HTTP endpoint.
    pub(crate) listen: Option<SocketAddr>,
    pub(crate) stats_refresh: Duration,
    pub(crate) check_timeout: Duration,
    pub(crate) stuck_after: Duration,
}

/// Everything validated.
#[derive(Debug)]
pub(crate) struct Settings {
    database: Option<DatabaseSettings>,
    database_error: String,
    pub(crate) tables: Tables,
    pub(crate) relay: RelayConfig,
    pub(crate) store: StoreConfig,
    pub(crate) wakeup: Wakeup,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) retention: RetentionSettings,
    pub(crate) http: HttpSettings,
    pub(crate) console: ConsoleSettings,
    pub(crate) broker: BrokerSection,
    pub(crate) routing: RoutingSection,
    pub(crate) envelope: Envelope,
    pub(crate) wal: Option<WalSettings>,
    /// `[[outbox]]`: empty when the process relays the one outbox of `tables`.
    pub(crate) outboxes: Vec<OutboxTarget>,
    pub(crate) tenants: Option<TenantsSettings>,
}

impl Settings {
    /// Whether the process relays several outboxes (`[[outbox]]` or `[tenants]`)
    /// rather than the one of `[tables]`.
    pub(crate) fn grouped(&self) -> bool {
        !self.outboxes.is_empty() || self.tenants.is_some()
    }

    /// The database settings, or the error explaining that no URL was given.
    pub(crate) fn database(&self) -> Result<&DatabaseSettings, Failure> {
        self.database
            .as_ref()
            .ok_or_else(|| Failure::config(self.database_error.clone()))
    }
}

/// Read `path` (if any), lay the environment over it, validate.
pub(crate) fn load(path: Option<&Path>) -> Result<Settings, Failure> {
    let text = match path {
        Some(path) => Some(Arc::new(ConfigText {
            path: path.display().to_string(),
            text: std::fs::read_to_string(path).map_err(|e| {
                Failure::config(format!("cannot read config file {}: {e}", path.display()))
            })?,
        })),
        None => None,
    };
    let mut table = match &text {
        Some(file) => parse_table(&file.text)
            .map_err(|e| Failure::config(format!("config file {}{e}", file.path)))?,
        None => toml::Table::new(),
    };
    apply_env(&mut table, &Vars::from_env()).map_err(Failure::config)?;
    let mut file = file_config(table).map_err(|e| Failure::config(e.message()))?;
    file.broker.text = text;
    validate(file)
}

/// The file's text as a table, once its sections have been read from it (so that
/// an error names its line); the error is `, line N: message`.
fn parse_table(text: &str) -> Result<toml::Table, String> {
    parse_str(text)?;
    text.parse().map_err(|e| toml_error(text, &e))
}

/// Parse TOML text; the error is `, line N: message` (one line, for the prefix above).
pub(crate) fn parse_str(text: &str) -> Result<FileConfig, String> {
    toml::from_str(text).map_err(|e: toml::de::Error| toml_error(text, &e))
}

/// Settings from a file's text, as `load` reads them (tests of what reads the text).
#[cfg(test)]
pub(crate) fn from_text(text: &str) -> Result<Settings, String> {
    let mut file = parse_str(text)?;
    file.broker.text = Some(Arc::new(ConfigText {
        path: "outbox.toml".into(),
        text: text.into(),
    }));
    validate(file).map_err(|e| e.to_string())
}

/// A TOML error of `text` as `, line N: message`, on one line.
pub(crate) fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let line = e
        .span()
        .map(|span| {
            let start = span.start.min(text.len());
            format!(
                ", line {}",
                text.as_bytes()[..start]
                    .iter()
                    .filter(|b| **b == b'\n')
                    .count()
                    + 1
            )
        })
        .unwrap_or_default();
    let message = e.message().split_whitespace().collect::<Vec<_>>().join(" ");
    format!("{line}: {message}")
}

/// How an environment variable's text becomes the value of its key.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// As written (trimmed): strings, durations, retention, enum names.
    Text,
    /// A whole number.
    Number,
    /// On or off ([`flag`]).
    Switch,
}

/// Environment variables that override the file: the key each one sets, as if the
/// file held it.
#[rustfmt::skip]
const ENV_VARS: &[(&str, &str, Kind)] = &[
    ("OUTBOX_DATABASE_URL",             "database.url",             Kind::Text),
    ("OUTBOX_DATABASE_PASSWORD_FILE",   "database.password_file",   Kind::Text),
    ("OUTBOX_DATABASE_MAX_CONNECTIONS", "database.max_connections", Kind::Number),
    ("OUTBOX_SCHEMA",                   "tables.schema",            Kind::Text),
    ("OUTBOX_EVENTS_TABLE",             "tables.events_table",      Kind::Text),
    ("OUTBOX_INBOX_TABLE",              "tables.inbox_table",       Kind::Text),
    ("OUTBOX_BROKER",                   "broker.kind",              Kind::Text),
    ("OUTBOX_BATCH_SIZE",               "relay.batch_size",         Kind::Number),
    ("OUTBOX_WORKERS",                  "relay.workers",            Kind::Number),
    ("OUTBOX_POLL_INTERVAL",            "relay.poll_interval",      Kind::Text),
    ("OUTBOX_PUBLISH_TIMEOUT",          "relay.publish_timeout",    Kind::Text),
    ("OUTBOX_BROKER_PROBE_MAX",         "relay.broker_probe_max",   Kind::Text),
    ("OUTBOX_ORDERING",                 "relay.ordering",           Kind::Switch),
    ("OUTBOX_SYNCHRONOUS_COMMIT",       "relay.synchronous_commit", Kind::Switch),
    ("OUTBOX_SHUTDOWN_TIMEOUT",         "relay.shutdown_timeout",   Kind::Text),
    ("OUTBOX_WAKEUP",                   "relay.wakeup",             Kind::Text),
    ("OUTBOX_MAX_ATTEMPTS",             "retry.max_attempts",       Kind::Number),
    ("OUTBOX_RETENTION",                "retention.published",      Kind::Text),
    ("OUTBOX_HTTP_LISTEN",              "http.listen",              Kind::Text),
    ("OUTBOX_HTTP_STUCK_AFTER",         "http.stuck_after",         Kind::Text),
    ("OUTBOX_CONSOLE",                  "console.enabled",          Kind::Switch),
    ("OUTBOX_CONSOLE_TOKEN_FILE",       "console.token_file",       Kind::Text),
    (envelope::VAR_ENVELOPE,            "envelope.format",          Kind::Text),
    (envelope::VAR_CLOUDEVENTS_SOURCE,  "envelope.source",          Kind::Text),
    (envelope::VAR_CLOUDEVENTS_SUBJECT, "envelope.subject",         Kind::Text),
    ("OUTBOX_WAL",                      "wal.enabled",              Kind::Switch),
    ("OUTBOX_WAL_SLOT",                 "wal.slot",                 Kind::Text),
    ("OUTBOX_WAL_REPLICATION_URL",      "wal.replication_url",      Kind::Text),
];

/// Lay every `OUTBOX_*` variable that is set over the file's `table` (an empty or
/// blank one counts as unset, as [`Vars`] reads every variable): each sets its key,
/// so the file's rules (the sections' types) are the only rules. A value its key
/// refuses is an error naming the variable, and is not laid over `table`.
fn apply_env(table: &mut toml::Table, vars: &Vars) -> Result<(), String> {
    for (name, key, kind) in ENV_VARS {
        let Some(value) = vars.text(name) else {
            continue;
        };
        let bad = |reason: String| format!("environment variable {name}=`{value}`: {reason}");
        let text = value.trim();
        let setting = match kind {
            Kind::Text => toml::Value::String(text.to_string()),
            Kind::Number => toml::Value::Integer(text.parse().map_err(|e| bad(format!("{e}")))?),
            Kind::Switch => toml::Value::Boolean(
                flag(text).ok_or_else(|| bad("expected true or false".into()))?,
            ),
        };
        // The value alone, read as the file would be: an error here is this
        // variable's.
        let mut alone = toml::Table::new();
        set_key(&mut alone, key, setting.clone());
        file_config(alone).map_err(|e| bad(e.message().to_string()))?;
        set_key(table, key, setting);
    }
    // The variable most tools (sqlx, Heroku-style platforms) set, when neither the
    // file nor OUTBOX_DATABASE_URL names a database.
    let url_set = table
        .get("database")
        .and_then(|d| d.get("url"))
        .and_then(toml::Value::as_str)
        .is_some_and(|u| !u.trim().is_empty());
    if !url_set {
        if let Some(url) = vars.text("DATABASE_URL") {
            set_key(table, "database.url", toml::Value::String(url));
        }
    }
    Ok(())
}

/// Set `section.key` of `table`, creating the section.
fn set_key(table: &mut toml::Table, key: &str, value: toml::Value) {
    let (section, key) = key.split_once('.').expect("keys are section.key");
    if let toml::Value::Table(section) = table
        .entry(section)
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
    {
        section.insert(key.to_string(), value);
    }
}

/// The file's sections from a table.
fn file_config(table: toml::Table) -> Result<FileConfig, toml::de::Error> {
    toml::Value::Table(table).try_into()
}

/// An on/off environment value: `true`/`1`/`on`/`yes` or `false`/`0`/`off`/`no`.
fn flag(value: &str) -> Option<bool> {
    match value.trim() {
        "true" | "1" | "on" | "yes" => Some(true),
        "false" | "0" | "off" | "no" => Some(false),
        _ => None,
    }
}

fn validate(file: FileConfig) -> Result<Settings, Failure> {
    let config = |m: String| Failure::config(m);
    let e = &file.envelope;
    let envelope = Envelope::from_settings(
        e.format.as_deref().unwrap_or("outbox"),
        e.source.as_deref(),
        e.subject.as_deref(),
    )
    .map_err(|e| config(format!("envelope: {e}")))?;
    let grouped = !file.outboxes.is_empty() || file.tenants.is_some();
    if grouped && file.tables.is_some() {
        return Err(config(
            "[tables] (or OUTBOX_SCHEMA, OUTBOX_EVENTS_TABLE, OUTBOX_INBOX_TABLE) names one outbox, [[outbox]] and [tenants] several: list every outbox as an [[outbox]] entry instead".into(),
        ));
    }
    if grouped && file.wal.enabled {
        return Err(config(
            "wal.enabled: the WAL outbox is relayed alone; it cannot be combined with [[outbox]] or [tenants]".into(),
        ));
    }
    if grouped && file.relay.wakeup == WakeupMode::Notify {
        return Err(config(
            "relay.wakeup = \"notify\": a process relaying [[outbox]] or [tenants] wakes its outboxes with one shared probe per database; use \"adaptive\"".into(),
        ));
    }
    let default_tables = TablesSection::default();
    let file_tables = file.tables.as_ref().unwrap_or(&default_tables);
    let tables = Tables::in_schema(&file_tables.schema)
        .and_then(|t| t.with_events_table(&file_tables.events_table))
        .and_then(|t| t.with_inbox_table(&file_tables.inbox_table))
        .map_err(|e| config(format!("tables: {e}")))?;
    let wal = wal_settings(&file.wal, &tables).map_err(|e| config(format!("wal: {e}")))?;

    let r = &file.relay;
    check_limits("relay", r.batch_size, r.workers).map_err(config)?;
    for (key, d) in [
        ("relay.poll_interval", r.poll_interval),
        ("relay.publish_timeout", r.publish_timeout),
        ("relay.pending_refresh", r.pending_refresh),
        ("relay.broker_probe_max", r.broker_probe_max),
        ("relay.shutdown_timeout", r.shutdown_timeout),
        (
            "retention.cleanup_interval",
            file.retention.cleanup_interval,
        ),
        ("http.stats_refresh", file.http.stats_refresh),
        ("http.check_timeout", file.http.check_timeout),
        ("database.connect_timeout", file.database.connect_timeout),
    ] {
        if d.0.is_zero() {
            return Err(config(format!("{key}: must be greater than zero")));
        }
    }
    let retry = &file.retry;
    if retry.max_attempts == 0 {
        return Err(config("retry.max_attempts: must be at least 1".into()));
    }
    if retry.base_delay > retry.max_delay {
        return Err(config(format!(
            "retry.base_delay ({}) is larger than retry.max_delay ({})",
            Dur(retry.base_delay),
            Dur(retry.max_delay)
        )));
    }
    let claim_timeout = (!file.database.claim_timeout.0.is_zero() && !file.database.pgbouncer)
        .then_some(file.database.claim_timeout.0);
    if let Some(claim) = claim_timeout {
        if claim <= r.publish_timeout.0 {
            return Err(config(format!(
                "database.claim_timeout ({}) must be longer than relay.publish_timeout ({}), \
                 or a slow batch loses its claim",
                file.database.claim_timeout, r.publish_timeout
            )));
        }
    }

    // The longest normal cycle: a batch's publish, then an empty claim's wait; the
    // database's part of a cycle takes milliseconds, the margin covers it.
    let longest_cycle = r.publish_timeout.0 + r.poll_interval.0;
    let stuck_after = match file.http.stuck_after {
        None => longest_cycle + Duration::from_secs(60),
        Some(d) if d.0 <= longest_cycle => {
            return Err(config(format!(
                "http.stuck_after ({d}) must be longer than relay.publish_timeout + \
                 relay.poll_interval ({}), the longest normal cycle of a claim loop",
                Dur(longest_cycle)
            )));
        }
        Some(d) => d.0,
    };

    let listen = match file.http.listen.trim() {
        "" | "0" | "off" | "false" => None,
        text => Some(text.parse::<SocketAddr>().map_err(|e| {
            config(format!(
                "http.listen = `{text}`: {e} (write host:port, e.g. 127.0.0.1:9187, or \"0\" to disable)"
            ))
        })?),
    };
    if file.console.sample_interval.0 < Duration::from_millis(100) {
        return Err(config(format!(
            "console.sample_interval ({}) must be at least 100ms",
            file.console.sample_interval
        )));
    }
    if file.console.enabled && listen.is_none() {
        return Err(config(
            "console.enabled = true needs the HTTP listener it is served on: set http.listen to an address".into(),
        ));
    }

    let workers = u32::try_from(r.workers).unwrap_or(64);
    let (database, database_error) = match file.database.url.as_deref().map(str::trim) {
        Some(url) if !url.is_empty() => {
            // Several outboxes share one pool per database: their budget.
            let default = if grouped { (workers + 3).max(10) } else { workers + 3 };
            let max_connections = file.database.max_connections.unwrap_or(default);
            if max_connections < 2 {
                return Err(config(
                    "database.max_connections: must be at least 2 (claims hold one each)".into(),
                ));
            }
            (
                Some(DatabaseSettings {
                    url: url.to_string(),
                    password_file: file.database.password_file.clone(),
                    max_connections,
                    connect_timeout: file.database.connect_timeout.0,
                    claim_timeout,
                    pgbouncer: file.database.pgbouncer,
                    statement_cache: if grouped { 1000 } else { 100 },
                }),
                String::new(),
            )
        }
        _ => (
            None,
            "no database URL: set database.url in the config file (--config), OUTBOX_DATABASE_URL or DATABASE_URL"
                .to_string(),
        ),
    };

    // Both structs are `#[non_exhaustive]`: start from the defaults, set what the file maps.
    let mut relay = RelayConfig::default();
    relay.batch_size = r.batch_size;
    relay.poll_interval = r.poll_interval.0;
    relay.publish_timeout = r.publish_timeout.0;
    relay.retry = *retry;
    relay.workers = r.workers;
    relay.pending_refresh = r.pending_refresh.0;
    relay.error_backoff = r.error_backoff.0;
    relay.broker_probe_min = relay.broker_probe_min.min(r.broker_probe_max.0);
    relay.broker_probe_max = r.broker_probe_max.0;
    relay.event_type_labels = r.event_type_labels;
    let mut store = StoreConfig::default();
    store.ordering = r.ordering;
    store.after_dead_letter = r.after_dead_letter;
    store.retention = file.retention.published.0;
    store.synchronous_commit = r.synchronous_commit;
    let outboxes = outbox_targets(&file.outboxes, &relay).map_err(config)?;
    let tenants = match &file.tenants {
        None => None,
        Some(t) => Some(tenants_settings(t, &relay).map_err(config)?),
    };
    let wakeup = match r.wakeup {
        WakeupMode::Adaptive => Wakeup::adaptive(),
        WakeupMode::Poll => Wakeup::FixedPoll,
        WakeupMode::Notify => {
            if file.database.pgbouncer && r.notify_url.is_none() {
                return Err(config(
                    "relay.wakeup = \"notify\" needs a direct PostgreSQL session: with database.pgbouncer, set relay.notify_url to a URL that bypasses the pooler".into(),
                ));
            }
            Wakeup::Notify {
                url: r.notify_url.clone(),
            }
        }
    };
    Ok(Settings {
        database,
        database_error,
        tables,
        relay,
        store,
        wakeup,
        shutdown_timeout: r.shutdown_timeout.0,
        retention: RetentionSettings {
            published: file.retention.published.0,
            cleanup_interval: file.retention.cleanup_interval.0,
            cleanup_batch_size: file.retention.cleanup_batch_size.max(1),
            inbox: file.retention.inbox.map(|d| d.0),
        },
        http: HttpSettings {
            listen,
            stats_refresh: file.http.stats_refresh.0,
            check_timeout: file.http.check_timeout.0,
            stuck_after,
        },
        console: ConsoleSettings {
            enabled: file.console.enabled,
            token_file: file.console.token_file,
            sample_interval: file.console.sample_interval.0,
        },
        broker: file.broker,
        routing: file.routing,
        envelope,
        wal,
        outboxes,
        tenants,
    })
}

/// `batch_size` and `workers` of `section` within their bounds.
fn check_limits(section: &str, batch_size: usize, workers: usize) -> Result<(), String> {
    if batch_size == 0 || batch_size > 10_000 {
        return Err(format!(
            "{section}.batch_size = {batch_size}: must be between 1 and 10000"
        ));
    }
    if workers == 0 || workers > 64 {
        return Err(format!(
            "{section}.workers = {workers}: must be between 1 and 64"
        ));
    }
    Ok(())
}

/// `relay` with an outbox's own limits laid over it.
fn with_limits(
    section: &str,
    relay: &RelayConfig,
    batch_size: Option<usize>,
    workers: Option<usize>,
) -> Result<RelayConfig, String> {
    let mut relay = relay.clone();
    relay.batch_size = batch_size.unwrap_or(relay.batch_size);
    relay.workers = workers.unwrap_or(relay.workers);
    check_limits(section, relay.batch_size, relay.workers)?;
    Ok(relay)
}

/// The `[[outbox]]` entries, each named (unique names) and with its limits.
fn outbox_targets(
    sections: &[OutboxSection],
    relay: &RelayConfig,
) -> Result<Vec<OutboxTarget>, String> {
    let mut targets: Vec<OutboxTarget> = Vec::with_capacity(sections.len());
    for (i, o) in sections.iter().enumerate() {
        let at = format!("outbox[{i}]");
        let defaults = Tables::default();
        let tables = Tables::in_schema(&o.schema)
            .and_then(|t| {
                t.with_events_table(
                    o.events_table
                        .as_deref()
                        .unwrap_or(defaults.events().as_str()),
                )
            })
            .and_then(|t| {
                t.with_inbox_table(
                    o.inbox_table
                        .as_deref()
                        .unwrap_or(defaults.inbox().as_str()),
                )
            })
            .map_err(|e| format!("{at}: {e}"))?;
        let name = match o.name.as_deref().map(str::trim) {
            None => tables.outbox_name(),
            Some("") => return Err(format!("{at}.name: must not be empty")),
            Some(name) => name.to_string(),
        };
        if let Some(other) = targets.iter().position(|t| t.name == name) {
            return Err(format!(
                "{at}: the name `{name}` is taken by outbox[{other}]: give one of them a `name` of its own"
            ));
        }
        let database_url = o
            .database_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(String::from);
        targets.push(OutboxTarget {
            relay: with_limits(&at, relay, o.batch_size, o.workers)?,
            name,
            tables,
            database_url,
        });
    }
    Ok(targets)
}

fn tenants_settings(t: &TenantsSection, relay: &RelayConfig) -> Result<TenantsSettings, String> {
    if t.schemas.trim().is_empty() {
        return Err(
            "tenants.schemas: give a LIKE pattern of schema names, e.g. \"tenant\\\\_%\"".into(),
        );
    }
    let events_table = t
        .events_table
        .clone()
        .unwrap_or_else(|| Tables::default().events().as_str().to_string());
    Ident::new("tenants.events_table", &events_table).map_err(|e| e.to_string())?;
    if t.interval.0.is_zero() {
        return Err("tenants.interval: must be greater than zero".into());
    }
    Ok(TenantsSettings {
        pattern: t.schemas.trim().to_string(),
        events_table,
        interval: t.interval.0,
        relay: with_limits("tenants", relay, t.batch_size, t.workers)?,
    })
}

/// The WAL settings when enabled: the publication named after the outbox
/// (`wal::slot::default_publication`; publications belong to one database) and
/// the slot named after the outbox and its database once connected, unless given.
fn wal_settings(
    section: &WalSection,
    tables: &Tables,
) -> Result<Option<WalSettings>, pgoutbox_postgres::Error> {
    if !section.enabled {
        return Ok(None);
    }
    let slot = section
        .slot
        .as_deref()
        .map(|slot| Ident::new("wal.slot", slot))
        .transpose()?;
    let publication = match section.publication.as_deref() {
        Some(publication) => Ident::new("wal.publication", publication)?,
        None => pgoutbox_postgres::wal::slot::default_publication(tables)?,
    };
    Ok(Some(WalSettings {
        slot,
        publication,
        replication_url: section.replication_url.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let s = validate(FileConfig::default()).unwrap();
        assert_eq!(s.relay.batch_size, 200);
        assert_eq!(s.http.listen, Some("127.0.0.1:9187".parse().unwrap()));
        assert!(s.database().is_err());
        assert_eq!(s.broker.kind, "stdout");
        assert_eq!(s.http.stuck_after, Duration::from_millis(90_100));
    }

    #[test]
    fn a_stuck_bound_shorter_than_a_normal_cycle_is_refused() {
        let mut file = FileConfig::default();
        file.http.stuck_after = Some(Dur::secs(30));
        let error = validate(file).unwrap_err().to_string();
        assert!(
            error.contains("http.stuck_after (30s) must be longer than relay.publish_timeout"),
            "{error}"
        );
    }

    #[test]
    fn wal_names_are_validated_and_defaults_fit() {
        let s = validate(parse_str("[wal]\nenabled = true\n").unwrap()).unwrap();
        let wal = s.wal.unwrap();
        // The slot's default depends on the database: resolved once connected.
        assert_eq!(wal.slot, None);
        assert_eq!(wal.publication.as_str(), "pgoutbox_public_outbox_events");
        let long = format!(
            "[tables]\nschema = \"{}\"\n[wal]\nenabled = true\n",
            "s".repeat(50)
        );
        let wal = validate(parse_str(&long).unwrap()).unwrap().wal.unwrap();
        assert_eq!(wal.publication.as_str().len(), 63, "{}", wal.publication);
        let s = validate(parse_str("[wal]\nenabled = true\nslot = \"orders_eu\"\n").unwrap());
        assert_eq!(s.unwrap().wal.unwrap().slot.unwrap().as_str(), "orders_eu");
        let err = validate(parse_str("[wal]\nenabled = true\nslot = \"Orders-EU\"\n").unwrap())
            .unwrap_err();
        assert!(
            err.message.contains("wal.slot") && err.message.contains("Orders-EU"),
            "{}",
            err.message
        );
    }

    #[test]
    fn unknown_keys_are_named_with_their_line() {
        let err = parse_str("[relay]\nbatch_size = 10\nbatch_sise = 20\n").unwrap_err();
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("batch_sise"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    #[test]
    fn durations_and_retention_parse() {
        let f = parse_str(
            "[relay]\npoll_interval = \"250ms\"\n[retention]\npublished = \"7d\"\n[http]\nlisten = \"0\"\n",
        )
        .unwrap();
        let s = validate(f).unwrap();
        assert_eq!(s.relay.poll_interval, Duration::from_millis(250));
        assert_eq!(
            s.retention.published,
            Retention::Keep(Duration::from_secs(7 * 86400))
        );
        assert_eq!(s.http.listen, None);
        assert!(parse_str("[retention]\npublished = \"forever\"\n")
            .unwrap_err()
            .contains("delete"));
    }

    #[test]
    fn env_overrides_the_file() {
        let mut t = parse_table("[relay]\nbatch_size = 10\n").unwrap();
        apply_env(
            &mut t,
            &Vars::new([
                ("OUTBOX_BATCH_SIZE", "50"),
                ("OUTBOX_RETENTION", "delete"),
                ("OUTBOX_DATABASE_URL", "postgres://x/y"),
                ("OUTBOX_WORKERS", " "),
            ]),
        )
        .unwrap();
        assert_eq!(file_config(t.clone()).unwrap().relay.batch_size, 50);
        let err = apply_env(&mut t, &Vars::new([("OUTBOX_WORKERS", "many")])).unwrap_err();
        assert!(err.contains("OUTBOX_WORKERS"), "{err}");
    }

    #[test]
    fn every_variable_names_a_key_of_the_file() {
        for (name, key, kind) in ENV_VARS {
            let value = match kind {
                Kind::Number => "1",
                Kind::Switch => "on",
                Kind::Text if *key == "relay.wakeup" => "poll",
                Kind::Text => "1s",
            };
            let mut t = toml::Table::new();
            apply_env(&mut t, &Vars::new([(*name, value)]))
                .unwrap_or_else(|e| panic!("{name} ({key}): {e}"));
            let (section, field) = key.split_once('.').unwrap();
            assert!(t[section].get(field).is_some(), "{name} sets {key}: {t:?}");
        }
        let err = apply_env(
            &mut toml::Table::new(),
            &Vars::new([("OUTBOX_WAKEUP", "often")]),
        )
        .unwrap_err();
        assert!(
            err.contains("OUTBOX_WAKEUP") && err.contains("often"),
            "{err}"
        );
        let mut t = toml::Table::new();
        apply_env(&mut t, &Vars::new([("OUTBOX_SCHEMA", "orders")])).unwrap();
        assert_eq!(file_config(t).unwrap().tables.unwrap().schema, "orders");
        let docs = include_str!("../../docs/operations.md");
        for (name, key, _) in ENV_VARS {
            let row = format!("| `{name}` | `{key}` |");
            assert!(docs.contains(&row), "docs/operations.md lacks {row}");
        }
    }

    #[test]
    fn broker_probe_max_from_the_environment() {
        let mut t = parse_table("[relay]\nbroker_probe_max = \"30s\"\n").unwrap();
        let f = file_config(t.clone()).unwrap();
        assert_eq!(f.relay.broker_probe_max.0, Duration::from_secs(30));
        apply_env(&mut t, &Vars::new([("OUTBOX_BROKER_PROBE_MAX", "2s")])).unwrap();
        let f = file_config(t.clone()).unwrap();
        assert_eq!(f.relay.broker_probe_max.0, Duration::from_secs(2));
        let err = apply_env(&mut t, &Vars::new([("OUTBOX_BROKER_PROBE_MAX", "soon")])).unwrap_err();
        assert!(err.contains("OUTBOX_BROKER_PROBE_MAX"), "{err}");
    }

    #[test]
    fn synchronous_commit_from_the_environment() {
        let mut t = parse_table(
            "[relay]
synchronous_commit = true
",
        )
        .unwrap();
        apply_env(&mut t, &Vars::new([("OUTBOX_SYNCHRONOUS_COMMIT", "false")])).unwrap();
        assert!(!file_config(t.clone()).unwrap().relay.synchronous_commit);
        let err = apply_env(
            &mut t,
            &Vars::new([("OUTBOX_SYNCHRONOUS_COMMIT", "sometimes")]),
        )
        .unwrap_err();
        assert!(err.contains("OUTBOX_SYNCHRONOUS_COMMIT"), "{err}");
        let f = file_config(t).unwrap();
        assert!(!f.relay.synchronous_commit, "a bad value changes nothing");
    }

    #[test]
    fn database_url_is_the_last_fallback() {
        let fallback = ("DATABASE_URL", "postgres://fallback/db");
        let with_env = |text: &str, vars: &[(&str, &str)]| {
            let mut table = parse_table(text).unwrap();
            apply_env(&mut table, &Vars::new(vars.iter().copied())).unwrap();
            file_config(table).unwrap()
        };
        let none = with_env("", &[fallback]);
        assert_eq!(none.database.url.as_deref(), Some("postgres://fallback/db"));
        let in_file = with_env("[database]\nurl = \"postgres://file/db\"\n", &[fallback]);
        assert_eq!(in_file.database.url.as_deref(), Some("postgres://file/db"));
        let from_outbox_var = with_env(
            "",
            &[("OUTBOX_DATABASE_URL", "postgres://outbox/db"), fallback],
        );
        assert_eq!(
            from_outbox_var.database.url.as_deref(),
            Some("postgres://outbox/db")
        );
    }

    #[test]
    fn the_example_file_is_valid_and_shows_the_defaults() {
        let f = parse_str(include_str!("../outbox.example.toml")).unwrap();
        let s = validate(f).unwrap();
        let d = validate(FileConfig::default()).unwrap();
        assert!(s.database().is_ok());
        assert_eq!(format!("{:?}", s.relay), format!("{:?}", d.relay));
        assert_eq!(s.store, d.store);
        assert_eq!(s.http.listen, d.http.listen);
        assert_eq!(s.http.stuck_after, d.http.stuck_after);
    }

    #[test]
    fn outbox_entries_get_names_limits_and_databases() {
        let f = parse_str(
            "[relay]\nbatch_size = 30\n\
             [[outbox]]\nschema = \"orders\"\n\
             [[outbox]]\nname = \"billing\"\nschema = \"public\"\nevents_table = \"events\"\n\
             database_url = \"postgres://b/billing\"\nworkers = 2\nbatch_size = 5\n\
             [tenants]\nschemas = \"tenant\\\\_%\"\n",
        )
        .unwrap();
        let s = validate(f).unwrap();
        assert!(s.grouped());
        let [orders, billing] = &s.outboxes[..] else {
            panic!("{:?}", s.outboxes)
        };
        assert_eq!(orders.name, "orders.outbox_events");
        assert_eq!(orders.database_url, None);
        assert_eq!((orders.relay.batch_size, orders.relay.workers), (30, 1));
        assert_eq!(billing.name, "billing");
        assert_eq!(billing.tables.outbox_name(), "public.events");
        assert_eq!(
            billing.database_url.as_deref(),
            Some("postgres://b/billing")
        );
        assert_eq!((billing.relay.batch_size, billing.relay.workers), (5, 2));
        let tenants = s.tenants.unwrap();
        assert_eq!(tenants.pattern, "tenant\\_%");
        assert_eq!(tenants.events_table, "outbox_events");
        assert_eq!(tenants.interval, Duration::from_secs(30));
        assert_eq!(tenants.relay.batch_size, 30);
        // Without them, one outbox: `[tables]`'s.
        assert!(!validate(FileConfig::default()).unwrap().grouped());
    }

    #[test]
    fn the_console_is_off_by_default_and_needs_the_listener() {
        let d = validate(FileConfig::default()).unwrap();
        assert!(!d.console.enabled);
        assert_eq!(d.console.token_file, None);
        assert_eq!(d.console.sample_interval, Duration::from_secs(5));
        let mut t = parse_table("[console]\nenabled = false\n").unwrap();
        apply_env(
            &mut t,
            &Vars::new([
                ("OUTBOX_CONSOLE", "true"),
                ("OUTBOX_CONSOLE_TOKEN_FILE", "/run/token"),
            ]),
        )
        .unwrap();
        let s = validate(file_config(t).unwrap()).unwrap();
        assert!(s.console.enabled);
        assert_eq!(s.console.token_file, Some(PathBuf::from("/run/token")));
        let off = parse_str("[http]\nlisten = \"0\"\n[console]\nenabled = true\n").unwrap();
        let err = validate(off).unwrap_err().message;
        assert!(
            err.contains("console.enabled") && err.contains("http.listen"),
            "{err}"
        );
    }

    #[test]
    fn bad_names_are_refused() {
        let f = parse_str("[tables]\nschema = \"Bad-Name\"\n").unwrap();
        let err = validate(f).unwrap_err().message;
        assert!(err.contains("invalid schema name"), "{err}");
    }
}
