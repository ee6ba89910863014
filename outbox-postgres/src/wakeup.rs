//! How an idle relay learns that new events were committed.
//!
//! - [`Wakeup::AdaptivePoll`] (the default): no cost for producers. Right after a
//!   claim found events the relay checks every `fast` (1 ms) for `linger` (20 ms)
//!   whether due events exist (one cheap `SELECT EXISTS`, not a claim transaction),
//!   then doubles the interval on every empty check up to the relay's
//!   `poll_interval`. Commit-to-publish latency under steady traffic is about
//!   `fast`; an idle relay costs `1 / poll_interval` claims a second; sparse
//!   traffic costs some 20-30 checks per event (see `docs/benchmarks-history.md`). When due
//!   events exist but claims find none of them free (other relays hold their
//!   aggregates), the relay backs off the same way instead of claiming in a loop.
//! - [`Wakeup::FixedPoll`]: sleep the relay's `poll_interval` after every empty claim.
//! - [`Wakeup::Notify`]: opt-in `LISTEN`/`NOTIFY`. Needs [`install_notify_trigger`],
//!   which makes every inserting statement `NOTIFY`. PostgreSQL serialises
//!   notifying commits on a cluster-wide lock held through commit, so they stop
//!   sharing WAL flushes: measured on our 2-core machine, 16 concurrent writers lost
//!   4.5x-6x of their throughput (see `docs/benchmarks-history.md`). `LISTEN` also needs a
//!   session of its own, directly on PostgreSQL: not through a transaction-pooling
//!   proxy (PgBouncer `pool_mode = transaction`). The claim and record path stays
//!   pooler-safe in every mode.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgListener;
use sqlx::{PgPool, Row};
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::error::Result;
use crate::shared_wakeup::SharedWakeup;
use crate::sql::Sql;
use crate::tables::Tables;

/// How an idle relay waits for new events. Defaults to [`Wakeup::adaptive`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Wakeup {
    /// Check for due events every `fast` for `linger` after the last claim that
    /// found events, then back off (doubling) to the relay's `poll_interval`.
    /// Costs producers nothing.
    AdaptivePoll {
        /// Interval while traffic is recent. [`Wakeup::adaptive`] uses 1 ms.
        fast: Duration,
        /// How long after the last event the fast interval is kept. [`Wakeup::adaptive`]
        /// uses 20 ms.
        linger: Duration,
    },
    /// Sleep the relay's `poll_interval` after every empty claim.
    FixedPoll,
    /// `LISTEN` for the notifications of [`install_notify_trigger`], falling back to
    /// polling at the relay's `poll_interval` (delayed events and retries do not
    /// notify, and notifications sent while the listener reconnects are lost).
    ///
    /// The listening session is opened on `url` when given, else taken from the
    /// store's pool: either must reach PostgreSQL directly, not through a
    /// transaction-pooling proxy.
    Notify {
        /// Database URL for the listening session; `None`: the store's pool.
        url: Option<String>,
    },
    /// One probe for many outboxes of one database ([`SharedWakeup`]): the
    /// stores given the same one ask their question in one statement per
    /// interval, on one connection. For one process relaying many outboxes
    /// (tenants); [`crate::RelayGroup`] sets it up.
    Shared(SharedWakeup),
}

impl Default for Wakeup {
    fn default() -> Self {
        Self::adaptive()
    }
}

impl Wakeup {
    /// [`Wakeup::AdaptivePoll`] with `fast` = 1 ms and `linger` = 20 ms.
    pub fn adaptive() -> Self {
        Self::AdaptivePoll {
            fast: Duration::from_millis(1),
            linger: Duration::from_millis(20),
        }
    }

    /// [`Wakeup::Notify`] on the store's pool.
    pub fn notify() -> Self {
        Self::Notify { url: None }
    }
}

/// Make every statement inserting into the events table of `tables` send a
/// notification, for relays using [`Wakeup::Notify`]. Idempotent.
///
/// This costs producers throughput (see [`Wakeup`]); measure before using it.
pub async fn install_notify_trigger(pool: &PgPool, tables: &Tables) -> Result<()> {
    let sql = Sql::new(tables);
    // Simple protocol: no prepared statement left behind (see `pooler.rs`).
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(&sql.drop_notify_trigger)
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(&sql.create_notify_trigger)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Remove the trigger of [`install_notify_trigger`]. Idempotent.
pub async fn remove_notify_trigger(pool: &PgPool, tables: &Tables) -> Result<()> {
    let sql = Sql::new(tables);
    sqlx::raw_sql(&sql.drop_notify_trigger)
        .execute(pool)
        .await?;
    Ok(())
}

/// The question an adaptive wait asks PostgreSQL: the probe function's call
/// (`Sql::probe_due`) and its arguments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probe<'a> {
    pub(crate) sql: &'a Sql,
    /// The store's statements are unnamed: its connections may go through a pooler.
    pub(crate) unnamed: bool,
    pub(crate) ordered: bool,
    /// Where ordered claims start their walk (`walk_start.rs`).
    pub(crate) walk_start: i64,
}

impl Probe<'_> {
    /// Whether due events exist (one statement, no transaction).
    async fn due(&self, pool: &PgPool) -> std::result::Result<bool, sqlx::Error> {
        if self.unnamed {
            // A prepared statement outside a transaction takes two round trips, and
            // a pooler may run the second on another server connection: one simple
            // query instead, with the arguments (a bool, an integer) written in.
            let sql = self.sql.probe_due_simple(self.ordered, self.walk_start);
            return sqlx::raw_sql(&sql).fetch_one(pool).await?.try_get(0);
        }
        sqlx::query_scalar(&self.sql.probe_due)
            .bind(self.ordered)
            .bind(self.walk_start)
            .fetch_one(pool)
            .await
    }
}

/// The wake-up state shared by the clones of one store.
#[derive(Debug)]
pub(crate) struct Waker {
    mode: Wakeup,
    /// Microseconds since `epoch` of the last claim that found events.
    last_found: AtomicU64,
    /// Empty polls since the fast phase ended.
    backoff_steps: AtomicU32,
    /// Claims in a row that found nothing although the probe had seen due events:
    /// other relays hold those events' aggregates.
    contended: AtomicU32,
    /// The last probe failed (logged once until one succeeds).
    probe_failing: AtomicBool,
    epoch: Instant,
    /// Notify mode: the listening task, started on first wait.
    listener: Mutex<Option<Listening>>,
    /// Notify mode: notifications received, and the count seen by the latest claim.
    received: Arc<AtomicU64>,
    seen_by_claim: AtomicU64,
    notified: Arc<Notify>,
    channel: String,
}

#[derive(Debug)]
struct Listening {
    task: AbortHandle,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Waker {
    pub(crate) fn new(mode: Wakeup, sql: &Sql) -> Self {
        Self {
            mode,
            last_found: AtomicU64::new(0),
            backoff_steps: AtomicU32::new(0),
            contended: AtomicU32::new(0),
            probe_failing: AtomicBool::new(false),
            epoch: Instant::now(),
            listener: Mutex::new(None),
            received: Arc::new(AtomicU64::new(0)),
            seen_by_claim: AtomicU64::new(0),
            notified: Arc::new(Notify::new()),
            channel: sql.notify_channel.clone(),
        }
    }

    pub(crate) fn mode(&self) -> &Wakeup {
        &self.mode
    }

    /// Called before each claim runs its query.
    pub(crate) fn claiming(&self) {
        let received = self.received.load(Ordering::Acquire);
        self.seen_by_claim.fetch_max(received, Ordering::AcqRel);
    }

    /// Called after each claim with the number of events found.
    pub(crate) fn claimed(&self, found: usize) {
        if found > 0 {
            let micros = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.last_found.store(micros, Ordering::Relaxed);
            self.backoff_steps.store(0, Ordering::Relaxed);
            self.contended.store(0, Ordering::Relaxed);
        }
    }

    /// Wait for due events; `probe` answers whether there are any.
    pub(crate) async fn wait(&self, pool: &PgPool, probe: Probe<'_>, timeout: Duration) {
        match &self.mode {
            Wakeup::FixedPoll => tokio::time::sleep(timeout).await,
            Wakeup::AdaptivePoll { fast, linger } => {
                self.wait_adaptive(pool, probe, *fast, *linger, timeout)
                    .await;
            }
            Wakeup::Notify { url } => self.wait_notified(pool, url.as_deref(), timeout).await,
            Wakeup::Shared(shared) => {
                self.pause_if_contended(shared.fast(), timeout).await;
                let call = probe.sql.probe_due_call(probe.ordered, probe.walk_start);
                let found = self.last_found.load(Ordering::Relaxed);
                let found_at = (found > 0).then(|| self.epoch + Duration::from_micros(found));
                if shared.wait(call, found_at, timeout).await {
                    self.contended.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// The last wait saw due events and the claim after it found none free (other
    /// relays hold their aggregates): wait longer each time, up to `timeout`,
    /// rather than claim in a loop.
    async fn pause_if_contended(&self, fast: Duration, timeout: Duration) {
        let contended = self.contended.load(Ordering::Relaxed);
        if contended > 0 {
            let pause = fast
                .saturating_mul(2u32.saturating_pow(contended.min(30)))
                .min(timeout);
            tokio::time::sleep(pause).await;
        }
    }

    /// Sleep the adaptive interval, then check for due events (one statement, no
    /// transaction) and return if there are some, else sleep a longer interval;
    /// return by `timeout` at the latest so the relay claims then anyway.
    async fn wait_adaptive(
        &self,
        pool: &PgPool,
        probe: Probe<'_>,
        fast: Duration,
        linger: Duration,
        timeout: Duration,
    ) {
        let deadline = Instant::now() + timeout;
        self.pause_if_contended(fast, timeout).await;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let interval = self.adaptive_interval(fast, linger, timeout);
            tokio::time::sleep(interval.min(left)).await;
            if interval >= left {
                return;
            }
            let due = probe.due(pool).await;
            if due.is_ok() {
                self.probe_failing.store(false, Ordering::Relaxed);
            }
            match due {
                Ok(false) => {}
                Ok(true) => {
                    self.contended.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                // The claim reports errors of the database; one of the probe
                // alone (its function missing) would go unseen.
                Err(e) => {
                    if !self.probe_failing.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "the wake-up probe failed; claiming instead");
                    }
                    return;
                }
            }
        }
    }

    fn adaptive_interval(&self, fast: Duration, linger: Duration, timeout: Duration) -> Duration {
        let last = Duration::from_micros(self.last_found.load(Ordering::Relaxed));
        let since = self.epoch.elapsed().saturating_sub(last);
        if since < linger {
            return fast.min(timeout);
        }
        let steps = self.backoff_steps.fetch_add(1, Ordering::Relaxed).min(30);
        fast.saturating_mul(2u32.saturating_pow(steps + 1))
            .min(timeout)
    }

    async fn wait_notified(&self, pool: &PgPool, url: Option<&str>, timeout: Duration) {
        self.ensure_listening(pool, url);
        let notified = self.notified.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // A notification that came after the latest claim started: claim again at once.
        if self.received.load(Ordering::Acquire) > self.seen_by_claim.load(Ordering::Acquire) {
            return;
        }
        let _ = tokio::time::timeout(timeout, notified).await;
    }

    fn ensure_listening(&self, pool: &PgPool, url: Option<&str>) {
        let Ok(mut listener) = self.listener.lock() else {
            return;
        };
        if listener.as_ref().is_some_and(|l| !l.task.is_finished()) {
            return;
        }
        let task = tokio::spawn(listen(
            pool.clone(),
            url.map(str::to_string),
            self.channel.clone(),
            Arc::clone(&self.received),
            Arc::clone(&self.notified),
        ));
        *listener = Some(Listening {
            task: task.abort_handle(),
        });
    }
}

/// Receive notifications until aborted, reconnecting after errors.
async fn listen(
    pool: PgPool,
    url: Option<String>,
    channel: String,
    received: Arc<AtomicU64>,
    notified: Arc<Notify>,
) {
    loop {
        let connected = match &url {
            Some(url) => PgListener::connect(url).await,
            None => PgListener::connect_with(&pool).await,
        };
        let mut listener = match connected {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "outbox wake-up: cannot connect the listener; polling meanwhile");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(error) = listener.listen(&channel).await {
            tracing::warn!(%error, %channel, "outbox wake-up: LISTEN failed; polling meanwhile");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => {
                    received.fetch_add(1, Ordering::AcqRel);
                    notified.notify_waiters();
                }
                // Connection lost and re-established: events may have been missed.
                Ok(None) => {
                    received.fetch_add(1, Ordering::AcqRel);
                    notified.notify_waiters();
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox wake-up: listener failed; reconnecting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}
