//! Helpers shared by the PostgreSQL integration tests.
#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;

use pgoutbox_core::{Event, Outcome, Publisher, Relay, RelayConfig, Store};
use pgoutbox_postgres::testing::{retries, TestOutbox};
use pgoutbox_postgres::{AfterDeadLetter, PgStore, StoreConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use uuid::Uuid;

#[allow(unused_imports)] // not every test uses it
pub use pgoutbox_core::testing::event;
use pgoutbox_core::testing::interleaved_events;

/// Enqueue `aggregates` x `per_aggregate` events, interleaved (a0#0, a1#0, ..., a0#1, ...),
/// committed in chunks. Returns the ids in insertion order.
pub async fn fill(db: &TestOutbox, aggregates: usize, per_aggregate: usize) -> Vec<Uuid> {
    let events = interleaved_events("a", aggregates, per_aggregate);
    let mut ids = Vec::with_capacity(events.len());
    for chunk in events.chunks(2000) {
        ids.extend(db.enqueue_many_committed(chunk).await.unwrap());
    }
    ids
}

/// A fresh outbox holding two committed events of aggregate `x`, the head and its
/// follower, and a store on it that treats a dead letter's followers by `policy`.
/// Returns the events' ids in order.
pub async fn head_and_follower(policy: AfterDeadLetter) -> (TestOutbox, PgStore, [Uuid; 2]) {
    let db = TestOutbox::new().await.unwrap();
    let ids = db
        .enqueue_many_committed(&[event("x", 0), event("x", 1)])
        .await
        .unwrap();
    let store = db
        .store()
        .with_config(StoreConfig::default().after_dead_letter(policy));
    (db, store, [ids[0], ids[1]])
}

/// A relay configuration for tests: quick polling, quick retries.
pub fn fast_config() -> RelayConfig {
    RelayConfig::default()
        .batch_size(100)
        .poll_interval(Duration::from_millis(10))
        .retry(retries(50, 1..=5))
        .pending_refresh(Duration::from_millis(200))
        .error_backoff(Duration::from_millis(20))
}

/// Resolves once the store has nothing pending (or after `limit`, then the test's
/// own assertions report what is left).
pub async fn drained(store: PgStore, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if store.pending().await.unwrap_or(1) == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Run `relays` until `shutdown` resolves for all of them.
pub async fn run_all<P: Publisher>(
    relays: &[Relay<PgStore, P>],
    shutdown: impl Future<Output = ()> + Clone + Send,
) {
    futures_util::future::join_all(relays.iter().map(|r| r.run(shutdown.clone()))).await;
}

/// Run `relays` until `db`'s outbox has nothing pending (at most `limit`).
pub async fn run_all_until_drained<P: Publisher>(
    relays: &[Relay<PgStore, P>],
    db: &TestOutbox,
    limit: Duration,
) {
    run_all(relays, drained(db.store(), limit).boxed().shared()).await;
}

/// Rows still in the events table.
pub async fn remaining(db: &TestOutbox) -> usize {
    row_ids(db).await.len()
}

/// Ids of the rows still in the events table, in insertion order.
pub async fn row_ids(db: &TestOutbox) -> Vec<Uuid> {
    sqlx::query_scalar(&format!(
        "SELECT id FROM {}.outbox_events ORDER BY seq",
        db.tables.schema().quoted()
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Spawn `run` with a shutdown future of its own; it resolves once the returned
/// sender is used (or dropped). `run` gets that future and runs until it resolves,
/// e.g. `|stopped| async move { relay.run(stopped).await }`.
pub fn spawn_until_stopped<F>(
    run: impl FnOnce(BoxFuture<'static, ()>) -> F,
) -> (oneshot::Sender<()>, JoinHandle<()>)
where
    F: Future<Output = ()> + Send + 'static,
{
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(run(Box::pin(async {
        let _ = stopped.await;
    })));
    (stop, running)
}

/// Fails a random 10% of publishes (retryable) and logs every success in order.
#[derive(Default)]
pub struct FlakyPublisher {
    pub log: Mutex<Vec<Event>>,
}

impl Publisher for FlakyPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut log = self.log.lock().unwrap();
        events
            .iter()
            .map(|e| {
                if fastrand::u8(0..10) == 0 {
                    Outcome::retryable("random broker hiccup")
                } else {
                    log.push(e.clone());
                    Outcome::Published
                }
            })
            .collect()
    }
}

/// The `seq`s of each aggregate's events in the order of their first publish in
/// `published`, after checking that they come in insertion order.
pub fn first_publishes_in_order(published: &[Event]) -> HashMap<String, Vec<i64>> {
    let mut seen = std::collections::HashSet::new();
    let mut per_aggregate: HashMap<String, Vec<i64>> = HashMap::new();
    for e in published {
        if seen.insert(e.id) {
            per_aggregate
                .entry(e.aggregate_id.clone())
                .or_default()
                .push(e.seq);
        }
    }
    for (aggregate, seqs) in &per_aggregate {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "aggregate {aggregate} out of order: {seqs:?}"
        );
    }
    per_aggregate
}

/// The walk start saved for ordered relays (migration 9), if one is.
pub async fn saved_walk_start(db: &TestOutbox) -> Option<i64> {
    sqlx::query_scalar(&format!(
        "SELECT from_seq FROM {}.outbox_events_walk_starts WHERE ordered",
        db.tables.schema().quoted()
    ))
    .fetch_optional(&db.pool)
    .await
    .unwrap()
}
