//! The WAL outbox's replication slot as the binary sees it: which one
//! (`wal.slot`, or the outbox's default name in its database), and whether it
//! can carry the outbox's events now.
//!
//! A slot decodes only the WAL of the database it was made in, so a slot that
//! exists is not enough: `migrate` and `check` refuse one that cannot carry this
//! database's events (`wal::slot::problem`), and a running relay reports it as not
//! ready, in the gauge `outbox_wal_slot_usable` and once in its log each time the
//! answer changes. Producers are refused by the library meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pgoutbox_postgres::wal::slot;
use pgoutbox_postgres::{Ident, Tables};
use sqlx::PgPool;

use crate::config::WalSettings;
use crate::exporter;
use crate::failure::Failure;

/// The slot of the outbox of `tables` in `pool`'s database (`wal::slot::resolve`).
pub(crate) async fn resolve(
    pool: &PgPool,
    tables: &Tables,
    wal: &WalSettings,
) -> Result<Ident, Failure> {
    let failed = |e: pgoutbox_postgres::Error| {
        Failure::runtime(format!("finding the WAL outbox's replication slot: {e}"))
    };
    let mut conn = pool.acquire().await.map_err(|e| failed(e.into()))?;
    slot::resolve(&mut conn, tables, wal.slot.as_ref())
        .await
        .map_err(failed)
}

/// `Ok` when `slot` can carry the outbox of `pool`'s database, else a config
/// failure with what was found and what to do.
pub(crate) async fn check(pool: &PgPool, slot: &Ident) -> Result<(), Failure> {
    match problem(pool, slot).await {
        Ok(None) => Ok(()),
        Ok(Some(problem)) => Err(Failure::config(format!("wal: {problem}"))),
        Err(e) => Err(Failure::runtime(format!(
            "checking the WAL outbox's replication slot {slot}: {e}"
        ))),
    }
}

/// `wal::slot::problem` on a connection of `pool`.
async fn problem(pool: &PgPool, slot: &Ident) -> Result<Option<String>, pgoutbox_postgres::Error> {
    let mut conn = pool.acquire().await?;
    slot::problem(&mut conn, slot).await
}

/// " (...)" after a slot name when it is the one earlier versions gave the outbox
/// by default (kept, with what it has not delivered yet), else nothing.
pub(crate) fn former_note(tables: &Tables, slot: &Ident) -> &'static str {
    if slot::former_default_name(tables).as_ref() == Some(slot) {
        " (the name earlier versions gave it by default; kept)"
    } else {
        ""
    }
}

/// A running relay's view of its slot, shared by the stats refresh and `/readyz`.
#[derive(Clone)]
pub(crate) struct SlotWatch {
    pub(crate) pool: PgPool,
    pub(crate) slot: Ident,
    /// The outbox, for the gauge's label and the log.
    pub(crate) outbox: String,
    /// The last answer, so that the log says each change once.
    usable: Arc<AtomicBool>,
}

impl SlotWatch {
    pub(crate) fn new(pool: PgPool, slot: Ident, outbox: String) -> Self {
        Self {
            pool,
            slot,
            outbox,
            usable: Arc::new(AtomicBool::new(true)),
        }
    }

    /// The last answer of [`SlotWatch::problem`]: whether the slot could carry the
    /// outbox's events then.
    pub(crate) fn usable(&self) -> bool {
        self.usable.load(Ordering::Relaxed)
    }

    /// Why the slot cannot carry the outbox's events now (`None`: it can); sets
    /// `outbox_wal_slot_usable` and logs a change. A failed look is an error and
    /// leaves the gauge as it was.
    pub(crate) async fn problem(&self) -> Result<Option<String>, pgoutbox_postgres::Error> {
        let problem = problem(&self.pool, &self.slot).await?;
        metrics::gauge!(exporter::WAL_SLOT_USABLE, "outbox" => self.outbox.clone())
            .set(if problem.is_none() { 1.0 } else { 0.0 });
        let was = self.usable.swap(problem.is_none(), Ordering::Relaxed);
        match (&problem, was) {
            (Some(problem), true) => tracing::error!(
                slot = %self.slot,
                outbox = %self.outbox,
                %problem,
                "the WAL outbox's slot cannot carry its events: none is read from the WAL \
                 and producers are refused; not ready until it can"
            ),
            (None, false) => tracing::info!(
                slot = %self.slot,
                outbox = %self.outbox,
                "the WAL outbox's slot can carry its events again"
            ),
            _ => {}
        }
        Ok(problem)
    }
}
