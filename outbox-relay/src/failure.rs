//! What a command reports when it fails: one line for stderr and an exit code.

use std::fmt;

/// Exit code of configuration and usage mistakes (as clap's own usage errors).
pub(crate) const EXIT_CONFIG: u8 = 2;
/// Exit code of failures at run time: database or broker unreachable, SQL errors.
pub(crate) const EXIT_RUNTIME: u8 = 1;

/// A failed command: printed as `outbox: <message>` on one line.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) message: String,
    pub(crate) code: u8,
}

impl Failure {
    /// A mistake in the configuration or the command line.
    pub(crate) fn config(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code: EXIT_CONFIG,
        }
    }

    /// A failure while running.
    pub(crate) fn runtime(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code: EXIT_RUNTIME,
        }
    }

    /// The message on one line: error chains and driver messages can hold newlines.
    pub(crate) fn one_line(&self) -> String {
        self.message
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.one_line())
    }
}

/// A database error while doing `what`.
pub(crate) fn db(what: &str) -> impl Fn(pgoutbox_postgres::Error) -> Failure + '_ {
    move |e| Failure::runtime(format!("{what}: {e}"))
}

/// A store error (any store's administration) while doing `what`.
pub(crate) fn store(what: &str) -> impl Fn(pgoutbox_core::StoreError) -> Failure + '_ {
    move |e| Failure::runtime(format!("{what}: {e}"))
}
