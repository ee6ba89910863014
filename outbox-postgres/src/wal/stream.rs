//! The relay side's source: an outbox's events from its logical replication slot.

use std::path::PathBuf;
use std::time::Duration;

use pgoutbox_core::Event;
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig,
};

use super::message::WalMessage;

/// Where a [`WalStream`] (and a [`super::WalStore`]) reads from.
#[derive(Clone)]
#[non_exhaustive]
pub struct WalSource {
    /// A `postgres://` URL of a role with `REPLICATION`, direct (no pooler); its
    /// `sslmode` (`require`, `verify-ca`, `verify-full`) and `sslrootcert` are
    /// honoured.
    pub database_url: String,
    /// A password replacing the URL's (e.g. read from a mounted secret).
    pub password: Option<String>,
    /// The slot ([`super::slot::create`]).
    pub slot: String,
    /// The publication ([`super::slot::create`]).
    pub publication: String,
    /// Transactions read ahead of the relay at most. Defaults to 64.
    pub read_ahead: usize,
    /// How often acknowledged positions reach the server. Defaults to 1 s.
    pub status_interval: Duration,
    /// Pause before reconnecting after the stream failed or while another reader
    /// holds the slot. Defaults to 1 s.
    pub reconnect_delay: Duration,
    /// How often the server reports its WAL position while none of this outbox's
    /// events arrive, which an idle relay acknowledges so that the slot does not
    /// keep the server's WAL (the connection's `wal_sender_timeout` is twice
    /// this: a reader silent for that long is disconnected). Defaults to 30 s, the
    /// server's default behaviour.
    pub heartbeat: Duration,
}

impl std::fmt::Debug for WalSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalSource")
            .field(
                "database_url",
                &pgoutbox_core::redact_url(&self.database_url),
            )
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("read_ahead", &self.read_ahead)
            .field("status_interval", &self.status_interval)
            .field("reconnect_delay", &self.reconnect_delay)
            .field("heartbeat", &self.heartbeat)
            .finish()
    }
}

impl WalSource {
    /// Defaults, reading `slot` through `publication` over `database_url`.
    pub fn new(
        database_url: impl Into<String>,
        slot: impl Into<String>,
        publication: impl Into<String>,
    ) -> Self {
        Self {
            database_url: database_url.into(),
            password: None,
            slot: slot.into(),
            publication: publication.into(),
            read_ahead: 64,
            status_interval: Duration::from_secs(1),
            reconnect_delay: Duration::from_secs(1),
            heartbeat: Duration::from_secs(30),
        }
    }
}

/// What the stream yields.
#[derive(Debug)]
#[non_exhaustive]
pub enum WalEvent {
    /// The outbox events of one committed transaction, in the order they were
    /// enqueued (the commit order of the stream). Acknowledge `end_lsn` with
    /// [`WalStream::ack`] once every one of them, and of the transactions before,
    /// was published. A transaction without outbox events is not yielded.
    Transaction {
        /// The events; `seq` numbers them in stream order.
        events: Vec<Event>,
        /// Where the transaction ends in the WAL.
        end_lsn: u64,
    },
    /// The server's WAL position while nothing of this outbox arrives: with
    /// nothing in flight, acknowledge it so the slot does not pin WAL.
    Idle {
        /// The server's WAL end.
        wal_end: u64,
    },
}

/// The stream failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WalStreamError {
    /// The database URL cannot be used for a replication connection.
    #[error("WAL stream: database URL: {0}")]
    Url(String),
    /// The replication connection failed or ended (server restart, slot missing,
    /// slot in use by another reader, authentication).
    #[error("WAL stream: {0}")]
    Replication(#[from] PgWireError),
    /// A message with this outbox's prefix does not decode: not written by this
    /// version of the outbox.
    #[error("WAL stream: message at {lsn} is not an outbox event: {reason}")]
    Malformed {
        /// Where it is in the WAL.
        lsn: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// An outbox's events read from its slot: one reader per slot (the server refuses
/// a second while the first is active).
pub struct WalStream {
    client: ReplicationClient,
    prefix: String,
    seq: i64,
    /// The transaction being received: its events wait for its commit.
    open: Vec<Event>,
}

impl std::fmt::Debug for WalStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalStream")
            .field("prefix", &self.prefix)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl WalStream {
    /// Start reading `source`'s slot (created with [`super::slot::create`]),
    /// keeping the messages with `prefix` ([`super::WalOutbox::prefix`]). The
    /// stream starts after the slot's confirmed position: what was acknowledged is
    /// not read again. While another reader holds the slot, the server refuses
    /// (an error saying the slot "is active").
    pub async fn connect(
        source: &WalSource,
        prefix: impl Into<String>,
    ) -> Result<Self, WalStreamError> {
        let mut config =
            replication_config(&source.database_url, &source.slot, &source.publication)?
                .with_status_interval(source.status_interval)
                .with_application_name("pgoutbox-wal-relay")
                // The server pings a silent reader after half its wal_sender_timeout.
                .with_options(format!(
                    "-c wal_sender_timeout={}",
                    (source.heartbeat * 2).as_millis().max(2)
                ));
        if let Some(password) = &source.password {
            config.password = password.clone();
        }
        let mut client = ReplicationClient::connect(config).await?;
        client.wait_started().await?;
        Ok(Self {
            client,
            prefix: prefix.into(),
            seq: 0,
            open: Vec::new(),
        })
    }

    /// The next committed transaction with outbox events, or the server's position
    /// while idle; `None` once the stream was stopped.
    pub async fn next(&mut self) -> Result<Option<WalEvent>, WalStreamError> {
        loop {
            let Some(event) = self.client.recv().await? else {
                return Ok(None);
            };
            match event {
                ReplicationEvent::Begin { .. } => self.open.clear(),
                ReplicationEvent::Message {
                    transactional,
                    lsn,
                    prefix,
                    content,
                } if prefix == self.prefix => {
                    if !transactional {
                        // The producer always emits transactional messages; one that is
                        // not was written by something else under our prefix.
                        tracing::warn!(lsn = %lsn, "non-transactional message with the outbox prefix; skipped");
                        continue;
                    }
                    let message = WalMessage::decode(&content).map_err(|reason| {
                        WalStreamError::Malformed {
                            lsn: lsn.to_pg_string(),
                            reason,
                        }
                    })?;
                    self.seq += 1;
                    self.open.push(message.into_event(self.seq));
                }
                ReplicationEvent::Commit { end_lsn, .. } if !self.open.is_empty() => {
                    return Ok(Some(WalEvent::Transaction {
                        events: std::mem::take(&mut self.open),
                        end_lsn: end_lsn.0,
                    }));
                }
                ReplicationEvent::KeepAlive { wal_end, .. } if self.open.is_empty() => {
                    return Ok(Some(WalEvent::Idle { wal_end: wal_end.0 }));
                }
                _ => {}
            }
        }
    }

    /// Everything up to `lsn` is published: the server may forget it. Reported with
    /// the next status update (`status_interval`); a restart resumes after the last
    /// position the server confirmed.
    pub fn ack(&self, lsn: u64) {
        self.client.update_applied_lsn(Lsn(lsn));
    }

    /// Report the acknowledged position and close the connection.
    pub async fn close(mut self) -> Result<(), WalStreamError> {
        self.client.shutdown().await?;
        Ok(())
    }
}

/// A replication connection's settings from a `postgres://` URL.
fn replication_config(
    database_url: &str,
    slot: &str,
    publication: &str,
) -> Result<ReplicationConfig, WalStreamError> {
    let bad = |reason: String| WalStreamError::Url(reason);
    let url = url::Url::parse(database_url).map_err(|e| bad(e.to_string()))?;
    if !matches!(url.scheme(), "postgres" | "postgresql") {
        return Err(bad(format!(
            "scheme `{}`: expected postgres://",
            url.scheme()
        )));
    }
    let decode = |text: &str| percent_decode(text).map_err(|e| bad(format!("not UTF-8: {e}")));
    let host = url
        .host_str()
        .ok_or_else(|| bad("no host".into()))?
        .to_string();
    let user = decode(url.username())?;
    let password = decode(url.password().unwrap_or_default())?;
    let database = decode(url.path().trim_start_matches('/'))?;
    let database = if database.is_empty() {
        user.clone()
    } else {
        database
    };
    let mut sslmode = None;
    let mut root = None;
    for (key, value) in url.query_pairs() {
        match key.as_ref() {
            "sslmode" => sslmode = Some(value.into_owned()),
            "sslrootcert" => root = Some(PathBuf::from(value.as_ref())),
            _ => {}
        }
    }
    let tls = match sslmode.as_deref() {
        None | Some("disable" | "allow" | "prefer") => TlsConfig::disabled(),
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(root),
        Some("verify-full") => TlsConfig::verify_full(root),
        Some(other) => return Err(bad(format!("unknown sslmode `{other}`"))),
    };
    let mut config =
        ReplicationConfig::new(host, user, password, database, slot, publication).with_tls(tls);
    if let Some(port) = url.port() {
        config = config.with_port(port);
    }
    Ok(config)
}

/// `%XX` sequences decoded (URLs keep user names, passwords and database names
/// percent-encoded).
fn percent_decode(text: &str) -> Result<String, String> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(|decoded| decoded.into_owned())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_replication_settings_or_a_named_error() {
        let c = replication_config(
            "postgres://repl%40x:p%2Fw@db.example:6543/shop?sslmode=disable",
            "s",
            "p",
        )
        .unwrap();
        let shown = c.display_connection();
        assert!(
            shown.contains("db.example") && shown.contains("6543"),
            "{shown}"
        );
        assert!(!shown.contains("p/w"), "password shown: {shown}");
        assert!(matches!(
            replication_config("mysql://h/db", "s", "p"),
            Err(WalStreamError::Url(reason)) if reason.contains("mysql")
        ));
        assert!(replication_config("postgres://h/db?sslmode=sometimes", "s", "p").is_err());
        assert_eq!(percent_decode("a%2Fb%40c").unwrap(), "a/b@c");
        assert!(percent_decode("%FF").is_err());
    }
}
