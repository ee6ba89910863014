//! Helpers shared by the PostgreSQL integration tests.
#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used)]

use std::future::Future;
use std::time::Duration;

use pgoutbox_core::{NewEvent, Publisher, Relay, RelayConfig, RetryPolicy, Store};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::PgStore;
use uuid::Uuid;

pub fn event(aggregate: &str, n: usize) -> NewEvent {
    NewEvent::new(
        "order",
        aggregate,
        "order.created",
        &serde_json::json!({ "n": n }),
    )
}

/// Enqueue `aggregates` x `per_aggregate` events, interleaved (a0#0, a1#0, ..., a0#1, ...),
/// committed in chunks. Returns the ids in insertion order.
pub async fn fill(db: &TestOutbox, aggregates: usize, per_aggregate: usize) -> Vec<Uuid> {
    let events: Vec<NewEvent> = (0..per_aggregate)
        .flat_map(|n| (0..aggregates).map(move |a| event(&format!("a{a}"), n)))
        .collect();
    let mut ids = Vec::with_capacity(events.len());
    for chunk in events.chunks(2000) {
        let mut tx = db.pool.begin().await.unwrap();
        ids.extend(db.outbox.enqueue_many(&mut tx, chunk).await.unwrap());
        tx.commit().await.unwrap();
    }
    ids
}

/// A relay configuration for tests: quick polling, quick retries.
pub fn fast_config() -> RelayConfig {
    RelayConfig::default()
        .batch_size(100)
        .poll_interval(Duration::from_millis(10))
        .retry(
            RetryPolicy::default()
                .max_attempts(50)
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
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

/// Rows still in the events table.
pub async fn remaining(db: &TestOutbox) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.outbox_events",
        db.tables.schema().quoted()
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}
