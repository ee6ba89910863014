//! Errors of the PostgreSQL outbox.

use pgoutbox_core::{EventError, StoreError};

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in the PostgreSQL outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configured schema, table or consumer name is not acceptable.
    #[error("invalid {what} name {value:?}: {reason}")]
    InvalidIdentifier {
        /// Which name.
        what: &'static str,
        /// The name given.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// An event was refused before anything was written.
    #[error(transparent)]
    InvalidEvent(#[from] EventError),
    /// A configuration value is out of range.
    #[error("invalid outbox configuration: {0}")]
    InvalidConfig(String),
    /// Applying a migration failed; nothing of it was applied.
    #[error("outbox migration {version} ({name}) failed: {source}")]
    Migration {
        /// Migration version.
        version: i32,
        /// Migration name.
        name: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
    /// An existing table cannot be adopted as an outbox ([`crate::adopt`]).
    #[error("cannot adopt {table} as an outbox: {}", problems.join("; "))]
    CannotAdopt {
        /// `schema.table`.
        table: String,
        /// What is missing or conflicting, one item per column or object.
        problems: Vec<String>,
    },
    /// An adoption ([`crate::adopt`]) could not take the table's exclusive lock:
    /// a long transaction uses the table. The step that waited changed nothing;
    /// steps done before it stay done, and running the adoption again resumes.
    #[error("the lock of {table} was not free within {wait:?} in {tries} tries: a long transaction uses the table (see pg_stat_activity); run the adoption again to resume")]
    LockNotFree {
        /// `"schema"."table"`.
        table: String,
        /// The longest wait of each try.
        wait: std::time::Duration,
        /// How many tries.
        tries: u32,
    },
    /// The database reported an error.
    #[error("outbox database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The WAL outbox cannot do what was asked (e.g. delay an event with
    /// `not_before`, which needs the table), or the server is not set up for it.
    #[error("WAL outbox: {0}")]
    Wal(String),
    /// The WAL outbox's replication slot is missing or cannot carry this
    /// database's events (another database's, another plugin's, temporary,
    /// invalidated, still being created): events written now would never be
    /// published. Nothing was written; a write refused this way failed its
    /// statement, so its transaction cannot commit. `reason` says what was found
    /// and what to do.
    #[error("WAL outbox: {reason}")]
    WalSlot {
        /// The slot looked for.
        slot: String,
        /// What is wrong with it, and what to do.
        reason: String,
    },
}

impl Error {
    /// True when retrying the same call later may succeed (connection, pool, I/O problems).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Database(
                sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
            )
        )
    }
}

impl From<Error> for StoreError {
    fn from(error: Error) -> Self {
        StoreError::backend(error)
    }
}
