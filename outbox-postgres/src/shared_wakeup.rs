//! One wake-up probe for the outboxes of one database ([`Wakeup::Shared`]).
//!
//! Each relay that waits for events leaves the question its outbox asks (its
//! probe function's call, `sql.rs`) with the [`SharedWakeup`]; one task asks all
//! of them in one statement, then wakes the relays whose outbox has due events.
//! N idle relays cost one statement per interval instead of N, and their probes
//! one connection of the pool at a time instead of N. The interval adapts like
//! [`Wakeup::AdaptivePoll`]'s: `fast` while one of the waiting relays found events
//! in its last `linger`, then doubling up to `max`. A relay that is busy draining
//! does not wait, so it does not keep the probe fast for the others.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Row};
use tokio::sync::{oneshot, Notify};
use tokio::task::AbortHandle;

#[cfg(doc)]
use crate::wakeup::Wakeup;

/// Most probe calls in one statement (PostgreSQL allows 1,664 result columns).
const CALLS_PER_STATEMENT: usize = 1000;

/// The wake-up probe shared by the stores of one database: give each
/// [`crate::PgStore`] `Wakeup::Shared(shared.clone())`. The probe statements run
/// on the pool given here (the stores' pool, or any pool on the same database).
/// Cheap to clone; the probing task stops when the last clone is dropped.
#[derive(Clone)]
pub struct SharedWakeup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SharedWakeup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWakeup")
            .field("fast", &self.inner.fast)
            .field("linger", &self.inner.linger)
            .field("max", &self.inner.max)
            .finish_non_exhaustive()
    }
}

impl PartialEq for SharedWakeup {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for SharedWakeup {}

struct Inner {
    pool: PgPool,
    fast: Duration,
    linger: Duration,
    max: Duration,
    /// Relays waiting: their probe call, and how to wake them.
    waiting: Mutex<Vec<Waiter>>,
    /// A relay started waiting (wakes the task when nobody waited).
    arrived: Arc<Notify>,
    /// The last probe failed (logged once until one succeeds).
    failing: AtomicBool,
    task: Mutex<Option<AbortHandle>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let task = self.task.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(task) = task.take() {
            task.abort();
        }
    }
}

struct Waiter {
    call: String,
    /// When its relay last found events (probe fast within `linger` of it).
    found_at: Option<Instant>,
    wake: oneshot::Sender<()>,
}

impl SharedWakeup {
    /// Probe on `pool` with the adaptive intervals: 5 ms while a waiting relay
    /// found events in its last 50 ms, then doubling up to 25 ms. A relay also
    /// claims at its `poll_interval` whatever the probe says.
    ///
    /// Against [`Wakeup::adaptive`]'s 1 ms to `poll_interval` (100 ms): slower
    /// when busy, because each probe asks every waiting outbox and with many
    /// tenants receiving a little traffic some relay has almost always found
    /// events lately; faster when quiet, because one statement serves them all
    /// (a new tenant's event waits 25 ms at most for the probe).
    pub fn new(pool: PgPool) -> Self {
        Self::with_intervals(
            pool,
            Duration::from_millis(5),
            Duration::from_millis(50),
            Duration::from_millis(25),
        )
    }

    /// Probe every `fast` while a waiting relay found events in its last
    /// `linger`, then at intervals doubling up to `max`.
    pub fn with_intervals(pool: PgPool, fast: Duration, linger: Duration, max: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool,
                fast,
                linger,
                max: max.max(fast),
                waiting: Mutex::new(Vec::new()),
                arrived: Arc::new(Notify::new()),
                failing: AtomicBool::new(false),
                task: Mutex::new(None),
            }),
        }
    }

    /// The shortest probe interval: also the base of a contended relay's backoff.
    pub(crate) fn fast(&self) -> Duration {
        self.inner.fast
    }

    /// Wait until `call` (an outbox's probe call, e.g. `s.f(true, 0)`) answers
    /// true, at most `timeout`; `found_at`: when its relay last found events.
    /// Returns whether the probe saw due events.
    pub(crate) async fn wait(
        &self,
        call: String,
        found_at: Option<Instant>,
        timeout: Duration,
    ) -> bool {
        self.ensure_probing();
        let (wake, woken) = oneshot::channel();
        self.inner
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Waiter {
                call,
                found_at,
                wake,
            });
        self.inner.arrived.notify_one();
        matches!(tokio::time::timeout(timeout, woken).await, Ok(Ok(())))
    }

    fn ensure_probing(&self) {
        let mut task = self
            .inner
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        // The task holds the state weakly: dropping the last handle stops it.
        let inner = Arc::downgrade(&self.inner);
        *task = Some(tokio::spawn(probe_loop(inner)).abort_handle());
    }
}

/// Probe for the waiting relays until the [`SharedWakeup`] is dropped.
async fn probe_loop(inner: std::sync::Weak<Inner>) {
    let mut backoff_steps = 0u32;
    let mut conn = ProbeConnection::default();
    loop {
        let Some(state) = inner.upgrade() else {
            return;
        };
        let (nobody, recent) = {
            let mut waiting = state.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting.retain(|w| !w.wake.is_closed());
            let recent = |w: &Waiter| w.found_at.is_some_and(|t| t.elapsed() < state.linger);
            (waiting.is_empty(), waiting.iter().any(recent))
        };
        let interval = if recent {
            backoff_steps = 0;
            state.fast
        } else {
            backoff_steps = (backoff_steps + 1).min(30);
            state
                .fast
                .saturating_mul(2u32.saturating_pow(backoff_steps))
                .min(state.max)
        };
        if nobody {
            conn.give_back();
            // Wait holding only the notifier: the state may be dropped meanwhile
            // (which aborts this task).
            let arrived = Arc::clone(&state.arrived);
            drop(state);
            arrived.notified().await;
            continue;
        }
        drop(state);
        tokio::time::sleep(interval).await;
        let Some(state) = inner.upgrade() else {
            return;
        };
        // A claim may have started waiting for a connection meanwhile: it goes
        // first (the probe then waits its turn), and again after the probe.
        conn.give_back_if_pool_is_short(&state.pool);
        probe_once(&state, &mut conn).await;
        conn.give_back_if_pool_is_short(&state.pool);
    }
}

/// The connection the probe asks on, kept from one probe to the next while
/// relays wait: PL/pgSQL compiles each outbox's probe function and plans its
/// query once per session, so probing on whichever pooled connection is free
/// pays that for every outbox on every connection (a start of 50 outboxes on 8
/// connections: 400 compilations instead of 50), and each probe would also
/// wait for the pool. Given back when nobody waits, when a question failed (the
/// session is not trusted), and when the pool has no other connection to give
/// (a claim may be waiting for one): the probe still takes one connection of the
/// budget at most.
#[derive(Default)]
struct ProbeConnection(Option<PoolConnection<Postgres>>);

impl ProbeConnection {
    /// The kept connection, or one from the pool; [`keep`](Self::keep) it after
    /// a question it answered.
    async fn take(&mut self, pool: &PgPool) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        match self.0.take() {
            Some(conn) => Ok(conn),
            None => pool.acquire().await,
        }
    }

    fn keep(&mut self, conn: PoolConnection<Postgres>) {
        self.0 = Some(conn);
    }

    fn give_back(&mut self) {
        self.0 = None;
    }

    fn give_back_if_pool_is_short(&mut self, pool: &PgPool) {
        let full = pool.size() >= pool.options().get_max_connections();
        if self.0.is_some() && full && pool.num_idle() == 0 {
            self.give_back();
        }
    }
}

/// Ask every waiting relay's question; wake those with due events (and those
/// whose question fails, to claim instead).
async fn probe_once(state: &Inner, conn: &mut ProbeConnection) {
    let mut asked: Vec<Waiter> =
        std::mem::take(&mut *state.waiting.lock().unwrap_or_else(PoisonError::into_inner));
    asked.retain(|w| !w.wake.is_closed());
    let mut due = Vec::with_capacity(asked.len());
    for chunk in asked.chunks(CALLS_PER_STATEMENT) {
        let calls: Vec<&str> = chunk.iter().map(|w| w.call.as_str()).collect();
        match ask(&state.pool, conn, &calls).await {
            Ok(flags) => {
                state.failing.store(false, Ordering::Relaxed);
                due.extend(flags);
            }
            // One outbox's call can fail alone (its schema was dropped, its
            // migration is missing): ask each alone, so that the others keep
            // their probe and the failing one's relay claims and reports the error.
            Err(error) => {
                if !state.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(%error, "the shared wake-up probe failed; asking each outbox alone");
                }
                for call in calls {
                    due.push(ask(&state.pool, conn, &[call]).await.map_or(true, |f| f[0]));
                }
            }
        }
    }
    let mut still = Vec::new();
    for (waiter, due) in asked.into_iter().zip(due) {
        if due {
            let _ = waiter.wake.send(());
        } else {
            still.push(waiter);
        }
    }
    state
        .waiting
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(still);
}

/// The answers of `calls`, in one statement. Simple protocol: the calls change
/// with each walk start; nothing is prepared, and one round trip outside a
/// transaction is pooler-safe.
async fn ask(
    pool: &PgPool,
    conn: &mut ProbeConnection,
    calls: &[&str],
) -> Result<Vec<bool>, sqlx::Error> {
    let mut session = conn.take(pool).await?;
    let statement = format!("SELECT {}", calls.join(", "));
    // Executor's boxed future: RawSql's own `fetch_one` here would make the
    // spawned probe task's future not `Send` ("`Executor` is not general enough").
    // A session whose question failed is not kept (dropped: back to the pool).
    let row = sqlx::Executor::fetch_one(&mut *session, sqlx::raw_sql(&statement)).await?;
    conn.keep(session);
    (0..calls.len())
        .map(|i| row.try_get::<bool, _>(i))
        .collect()
}
