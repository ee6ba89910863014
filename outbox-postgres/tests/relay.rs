//! The relay against the real PostgreSQL: atomicity, concurrency, draining,
//! retries, shutdown and bad input.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{drained, event, fast_config, fill, remaining, row_ids, run_all_until_drained};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{Event, NewEvent, Outcome, Publisher, Relay, Store};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::{Error, PgStore, StoreConfig, Tables};
use uuid::Uuid;

#[tokio::test]
async fn rolled_back_event_is_never_published_committed_one_exactly_once() {
    let db = TestOutbox::new().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let lost = db.outbox.enqueue(&mut tx, &event("a", 1)).await.unwrap();
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let kept = db.outbox.enqueue(&mut tx, &event("b", 1)).await.unwrap();
    tx.commit().await.unwrap();

    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config());
    relay
        .run(drained(db.store(), Duration::from_secs(10)))
        .await;
    // A few more empty claims must not publish anything again.
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    }
    assert_eq!(publisher.published_ids(), vec![kept]);
    assert!(!publisher.published_ids().contains(&lost));
    assert_eq!(remaining(&db).await, 0);
    db.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_publish_twenty_thousand_events_exactly_once() {
    let db = TestOutbox::new().await.unwrap();
    let ids = fill(&db, 2000, 10).await;
    assert_eq!(ids.len(), 20_000);

    let publisher = Arc::new(RecordingPublisher::new());
    let relays: Vec<_> = (0..4)
        .map(|_| Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config()))
        .collect();
    run_all_until_drained(&relays, &db, Duration::from_secs(120)).await;

    let published = publisher.published_ids();
    let unique: HashSet<Uuid> = published.iter().copied().collect();
    assert_eq!(published.len(), 20_000, "duplicates or losses");
    assert_eq!(unique, ids.iter().copied().collect::<HashSet<_>>());
    assert_eq!(remaining(&db).await, 0);
    // Every relay did part of the work.
    for relay in &relays {
        assert!(relay.stats().snapshot().published > 0);
    }
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn backlog_is_drained_without_waiting_for_poll_ticks() {
    let db = TestOutbox::new().await.unwrap();
    fill(&db, 1000, 1).await;
    let relay = Relay::new(db.store(), RecordingPublisher::new()).with_config(
        // Only back-to-back claims can drain 10 batches within the test's time.
        fast_config()
            .batch_size(100)
            .poll_interval(Duration::from_secs(3600)),
    );
    tokio::time::timeout(
        Duration::from_secs(60),
        relay.run(drained(db.store(), Duration::from_secs(60))),
    )
    .await
    .expect("the relay stopped");
    let stats = relay.stats().snapshot();
    assert_eq!(stats.published, 1000);
    assert_eq!(stats.batches, 10);
    // 10 full batches, then at most one empty claim before it idles.
    assert!(stats.claims <= 11, "{stats:?}");
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn failed_publish_counts_an_attempt_and_succeeds_later_without_holding_back_others() {
    let db = TestOutbox::new().await.unwrap();
    // One transaction: the flaky event first, then five healthy ones.
    let events: Vec<NewEvent> = std::iter::once(event("x", 0))
        .chain((0..5).map(|n| event(&format!("h{n}"), n)))
        .collect();
    let mut healthy = db.enqueue_committed(&events).await.unwrap();
    let flaky = healthy.remove(0);

    let publisher = Arc::new(RecordingPublisher::failing_once(flaky, "connection reset"));
    let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config());
    let first = relay.run_once().await.unwrap();
    assert_eq!((first.claimed, first.published, first.retried), (6, 5, 1));
    assert_eq!(publisher.published_ids(), healthy);

    let (attempts, last_error): (i32, Option<String>) = sqlx::query_as(&format!(
        "SELECT attempts, last_error FROM {}.outbox_events WHERE id = $1",
        db.tables.schema().quoted()
    ))
    .bind(flaky)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (attempts, last_error.as_deref()),
        (1, Some("connection reset"))
    );

    relay
        .run(drained(db.store(), Duration::from_secs(10)))
        .await;
    assert_eq!(publisher.published_ids().last(), Some(&flaky));
    db.drop_schema().await.unwrap();
}

/// Publishes slowly, so a shutdown arrives while a batch is in flight.
struct SlowPublisher {
    inner: RecordingPublisher,
}

impl Publisher for SlowPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.inner.publish(events).await
    }
}

#[tokio::test]
async fn with_ordering_off_a_hot_aggregate_is_published_in_one_call() {
    let db = TestOutbox::new().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(db.outbox.enqueue(&mut tx, &event("hot", n)).await.unwrap());
    }
    tx.commit().await.unwrap();

    let store = db
        .store()
        .with_config(StoreConfig::default().ordering(false));
    assert!(!store.ordered());
    let relay = Relay::new(store, RecordingPublisher::new()).with_config(fast_config());
    assert_eq!(relay.run_once().await.unwrap().published, 5);
    assert_eq!(relay.publisher().calls(), 1, "one call for the whole claim");
    assert_eq!(relay.publisher().published_ids(), ids);
    assert!(db.store().ordered(), "ordering is on by default");
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn shutdown_returns_promptly_and_loses_nothing() {
    let db = TestOutbox::new().await.unwrap();
    let ids = fill(&db, 500, 1).await;
    let publisher = Arc::new(SlowPublisher {
        inner: RecordingPublisher::new(),
    });
    let relay =
        Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config().batch_size(50));
    let started = std::time::Instant::now();
    relay
        .run(tokio::time::sleep(Duration::from_millis(250)))
        .await;
    // The batch in flight at shutdown is finished, then the relay returns.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    let published: HashSet<Uuid> = publisher.inner.published_ids().into_iter().collect();
    assert!(!published.is_empty() && published.len() < ids.len());
    let still_there: HashSet<Uuid> = row_ids(&db).await.into_iter().collect();
    // Every event is either published (and its row gone) or still claimable.
    for id in &ids {
        assert!(
            published.contains(id) != still_there.contains(id),
            "event {id}: published={} still_there={}",
            published.contains(id),
            still_there.contains(id)
        );
    }
    assert_eq!(
        db.store().pending().await.unwrap() as usize,
        still_there.len()
    );
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn invalid_names_are_refused_before_any_sql() {
    // No database is involved: the names never reach SQL.
    for (result, expected) in [
        (
            Tables::in_schema("public; drop table x"),
            "invalid schema name",
        ),
        (Tables::in_schema("Tenant"), "invalid schema name"),
        (
            Tables::default().with_events_table("events\"x"),
            "invalid events table name",
        ),
        (
            Tables::default().with_inbox_table(""),
            "invalid inbox table name",
        ),
    ] {
        let error = result.unwrap_err();
        assert!(matches!(error, Error::InvalidIdentifier { .. }));
        assert!(error.to_string().contains(expected), "{error}");
    }
}

#[tokio::test]
async fn invalid_payload_is_refused_at_enqueue_and_nothing_is_written() {
    let db = TestOutbox::new().await.unwrap();
    let bad = NewEvent::from_json_str("order", "1", "order.created", "{\"total\": 10,");

    let mut tx = db.pool.begin().await.unwrap();
    let error = db.outbox.enqueue(&mut tx, &bad).await.unwrap_err();
    assert!(error.to_string().contains("is not valid JSON"), "{error}");
    // The transaction is still usable: the refusal happened before any SQL.
    let good = db.outbox.enqueue(&mut tx, &event("1", 1)).await.unwrap();
    // A batch with one bad event writes none of them.
    let error = db
        .outbox
        .enqueue_many(&mut tx, &[event("2", 1), bad.clone(), event("3", 1)])
        .await
        .unwrap_err();
    assert!(matches!(error, Error::InvalidEvent(_)));
    tx.commit().await.unwrap();

    assert_eq!(row_ids(&db).await, vec![good]);
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn migrate_is_idempotent_and_custom_names_work() {
    let db = TestOutbox::new().await.unwrap();
    let tables = db
        .tables
        .clone()
        .with_events_table("billing_events")
        .unwrap();
    // Twice, concurrently: the advisory lock serialises them.
    let (a, b) = tokio::join!(
        pgoutbox_postgres::migrate(&db.pool, &tables),
        pgoutbox_postgres::migrate(&db.pool, &tables)
    );
    a.unwrap();
    b.unwrap();
    pgoutbox_postgres::migrate(&db.pool, &tables).await.unwrap();

    let store = PgStore::new(db.pool.clone(), tables.clone()).with_config(StoreConfig::default());
    let mut tx = db.pool.begin().await.unwrap();
    let id = store
        .outbox()
        .enqueue(&mut tx, &event("1", 1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let publisher = RecordingPublisher::new();
    let relay = Relay::new(store, publisher);
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    assert_eq!(relay.publisher().published_ids(), vec![id]);
    // The default table in the same schema saw nothing.
    assert_eq!(remaining(&db).await, 0);
    db.drop_schema().await.unwrap();
}
