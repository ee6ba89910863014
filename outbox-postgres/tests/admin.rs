//! Dead-letter administration, the consumer inbox and retention cleanup against
//! the real PostgreSQL.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{event, fast_config};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{NewEvent, PublishError, Relay, Store};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::{
    Cleanup, DeadLetterFilter, DeadLetters, Inbox, InboxError, PgStore, Processed, Retention,
    StoreConfig,
};
use uuid::Uuid;

/// An event of type `poison`, which [`relay_poisoned`] dead-letters.
fn poison(aggregate_type: &str, aggregate: &str) -> NewEvent {
    NewEvent::new(aggregate_type, aggregate, "poison", &serde_json::json!({}))
}

/// Enqueue `events`, then relay them through `store` until it claims no more,
/// dead-lettering those of type `poison` with a permanent error. Returns their ids
/// and the ids published.
async fn relay_poisoned(
    db: &TestOutbox,
    store: PgStore,
    events: &[NewEvent],
) -> (Vec<Uuid>, Vec<Uuid>) {
    let ids = db.enqueue_many_committed(events).await.unwrap();
    let publisher = RecordingPublisher::failing_when(|e| {
        (e.event_type == "poison").then(|| PublishError::permanent("rejected by broker"))
    });
    let relay = Relay::new(store, publisher).with_config(fast_config());
    while relay.run_once().await.unwrap().claimed > 0 {}
    (ids, relay.publisher().published_ids())
}

/// A fresh outbox and a store on it that keeps published rows, for any age to
/// clean them up.
async fn outbox_keeping_published_rows() -> (TestOutbox, PgStore) {
    let db = TestOutbox::new().await.unwrap();
    let store = db
        .store()
        .with_config(StoreConfig::default().retention(Retention::Keep(Duration::ZERO)));
    (db, store)
}

/// `clean(age)`, a cleanup of what is older than `age`, deletes nothing of what is
/// under an hour old, then, 10 ms later, the `n` rows older than 1 ms.
async fn assert_cleans_only_old(n: u64, clean: impl AsyncFn(Duration) -> u64) {
    assert_eq!(
        clean(Duration::from_secs(3600)).await,
        0,
        "nothing that old"
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(clean(Duration::from_millis(1)).await, n);
}

#[tokio::test]
async fn dead_letters_can_be_listed_filtered_retried_and_purged() {
    let db = TestOutbox::new().await.unwrap();
    let (ids, _) = relay_poisoned(
        &db,
        db.store(),
        &[
            poison("order", "1"),
            event("2", 0),
            poison("order", "3"),
            poison("invoice", "9"),
        ],
    )
    .await;
    let dl = DeadLetters::new(db.pool.clone(), &db.outbox);
    let all = DeadLetterFilter::default();
    assert_eq!(dl.count(&all).await.unwrap(), 3);

    let orders = all.clone().aggregate_type("order");
    let listed: Vec<Uuid> = dl
        .list(&orders, 10)
        .await
        .unwrap()
        .iter()
        .map(|d| d.event.id)
        .collect();
    assert_eq!(listed, vec![ids[0], ids[2]]);
    let by_agg = all.clone().aggregate_id("3");
    assert_eq!(dl.count(&by_agg).await.unwrap(), 1);
    let by_type = all.clone().event_type("order.created");
    assert_eq!(dl.count(&by_type).await.unwrap(), 0);
    let old = all.clone().older_than(Duration::from_secs(3600));
    assert_eq!(dl.count(&old).await.unwrap(), 0);
    // The last error's text, whatever its case.
    let rejected = all.clone().error_contains("REJECTED BY");
    assert_eq!(dl.count(&rejected).await.unwrap(), 3);
    assert_eq!(dl.list(&rejected, 10).await.unwrap().len(), 3);
    let timeouts = rejected.clone().error_contains("timed out");
    assert_eq!(dl.count(&timeouts).await.unwrap(), 0);
    // Pages: each after the last one of the previous page.
    let first = dl.list_after(&all, None, 2).await.unwrap();
    let rest = dl
        .list_after(&all, Some(first[1].event.id), 2)
        .await
        .unwrap();
    let paged: Vec<Uuid> = first.iter().chain(&rest).map(|d| d.event.id).collect();
    assert_eq!(paged, vec![ids[0], ids[2], ids[3]]);

    let shown = dl.show(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        shown.last_error.as_deref(),
        Some("permanent: rejected by broker")
    );
    assert_eq!(shown.event.attempts, 1);
    assert!(
        dl.show(ids[1]).await.unwrap().is_none(),
        "published events are not dead letters"
    );

    // Retry one: it is published by the next relay run.
    assert_eq!(dl.retry(&DeadLetterFilter::id(ids[0])).await.unwrap(), 1);
    assert_eq!(dl.count(&all).await.unwrap(), 2);
    let relay = Relay::new(db.store(), RecordingPublisher::new()).with_config(fast_config());
    relay.run_once().await.unwrap();
    assert_eq!(relay.publisher().published_ids(), vec![ids[0]]);

    // Purge the invoices only.
    let invoices = all.clone().aggregate_type("invoice");
    assert_eq!(dl.purge(&invoices).await.unwrap(), 1);
    assert_eq!(
        dl.list(&all, 10)
            .await
            .unwrap()
            .iter()
            .map(|d| d.event.id)
            .collect::<Vec<_>>(),
        vec![ids[2]]
    );
    db.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_deliveries_of_one_event_run_the_handler_once() {
    let db = TestOutbox::new().await.unwrap();
    let inbox = Inbox::new(&db.outbox, "billing").unwrap();
    let event_id = Uuid::now_v7();
    let runs = Arc::new(AtomicU32::new(0));
    let deliver = || {
        let (pool, inbox, runs) = (db.pool.clone(), inbox.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            inbox
                .process(&pool, event_id, |_conn| {
                    Box::pin(async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        // Hold the transaction open while the other delivery arrives.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Ok::<_, std::convert::Infallible>(())
                    })
                })
                .await
        })
    };
    let (a, b) = tokio::join!(deliver(), deliver());
    let mut outcomes = vec![a.unwrap().unwrap(), b.unwrap().unwrap()];
    outcomes.sort_by_key(|o| matches!(o, Processed::Duplicate));
    assert_eq!(outcomes, vec![Processed::First(()), Processed::Duplicate]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Another consumer processes the same event on its own.
    let shipping = Inbox::new(&db.outbox, "shipping").unwrap();
    let r = shipping
        .process(&db.pool, event_id, |_| {
            Box::pin(async { Ok::<_, std::io::Error>(7) })
        })
        .await
        .unwrap();
    assert_eq!(r, Processed::First(7));
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn handler_error_rolls_back_so_a_later_delivery_runs_it_again() {
    let db = TestOutbox::new().await.unwrap();
    sqlx::query(&format!(
        "CREATE TABLE {}.stock (n int NOT NULL)",
        db.tables.schema().quoted()
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let insert = format!(
        "INSERT INTO {}.stock VALUES (1)",
        db.tables.schema().quoted()
    );
    let inbox = Inbox::new(&db.outbox, "stock").unwrap();
    let id = Uuid::now_v7();

    let failed = inbox
        .process(&db.pool, id, |conn| {
            let insert = insert.clone();
            Box::pin(async move {
                sqlx::query(&insert)
                    .execute(conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Err::<(), _>("downstream refused".to_string())
            })
        })
        .await;
    assert!(matches!(failed, Err(InboxError::Handler(ref e)) if e == "downstream refused"));

    let retried = inbox
        .process(&db.pool, id, |conn| {
            let insert = insert.clone();
            Box::pin(async move { sqlx::query(&insert).execute(conn).await.map(|_| ()) })
        })
        .await
        .unwrap();
    assert_eq!(retried, Processed::First(()));
    let duplicate = inbox
        .process(&db.pool, id, |_| {
            Box::pin(async { Ok::<_, sqlx::Error>(()) })
        })
        .await
        .unwrap();
    assert_eq!(duplicate, Processed::Duplicate);
    // The failed attempt's write was rolled back with its inbox record.
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.stock",
        db.tables.schema().quoted()
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows, 1);
    assert!(Inbox::new(&db.outbox, "Bad Name").is_err());
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn cleanup_removes_only_old_published_rows_and_old_inbox_records() {
    let (db, store) = outbox_keeping_published_rows().await;
    let (ids, published) = relay_poisoned(
        &db,
        store.clone(),
        &[
            event("1", 0),
            event("2", 0),
            event("3", 0),
            poison("order", "4"),
            event("5", 0).not_before(chrono::Utc::now() + chrono::Duration::hours(1)),
        ],
    )
    .await;
    assert_eq!(published, ids[..3].to_vec());

    let stats = store.stats().await.unwrap();
    assert_eq!(
        (
            stats.pending,
            stats.scheduled,
            stats.dead_letters,
            stats.processed_last_hour
        ),
        (1, 1, 1, 3)
    );
    // Published rows are kept while younger than the retention, and deleted, in
    // batches of 2, once older.
    let cleanup = Cleanup::new(db.pool.clone(), &db.outbox).with_batch_size(2);
    assert_cleans_only_old(3, async |age| {
        cleanup.processed_older_than(age).await.unwrap()
    })
    .await;
    assert_eq!(
        common::row_ids(&db).await,
        ids[3..].to_vec(),
        "dead and pending rows stay"
    );
    assert_eq!(store.pending().await.unwrap(), 1);

    let inbox = Inbox::new(&db.outbox, "c").unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    for _ in 0..3 {
        assert!(inbox.record(&mut conn, Uuid::now_v7()).await.unwrap());
    }
    drop(conn);
    assert_cleans_only_old(3, async |age| cleanup.inbox_older_than(age).await.unwrap()).await;
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn periodic_cleanup_deletes_published_rows_until_stopped() {
    let (db, store) = outbox_keeping_published_rows().await;
    db.enqueue_many_committed(&[event("1", 0), event("2", 0)])
        .await
        .unwrap();
    let relay = Relay::new(store, RecordingPublisher::new()).with_config(fast_config());
    assert_eq!(relay.run_once().await.unwrap().published, 2);
    assert_eq!(common::remaining(&db).await, 2, "kept after publishing");

    let cleanup = Cleanup::new(db.pool.clone(), &db.outbox);
    let (stop, task) = common::spawn_until_stopped(|stopped| async move {
        cleanup
            .run(
                Duration::from_millis(20),
                Duration::ZERO,
                Some(Duration::ZERO),
                stopped,
            )
            .await;
    });
    let mut left = 2;
    for _ in 0..250 {
        left = common::remaining(&db).await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0);
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn in_flight_counts_events_claimed_by_a_relay() {
    use pgoutbox_core::Claim;
    use pgoutbox_postgres::StoreConfig;
    // Ordered claims lock aggregates, unordered ones rows: both are counted.
    for ordering in [true, false] {
        let db = TestOutbox::new().await.unwrap();
        common::fill(&db, 10, 1).await;
        let store = db
            .store()
            .with_config(StoreConfig::default().ordering(ordering));
        assert_eq!(store.in_flight(100).await.unwrap(), Some(0));
        let claim = store.claim(4).await.unwrap();
        assert_eq!(claim.events().len(), 4);
        assert_eq!(
            store.in_flight(100).await.unwrap(),
            Some(4),
            "ordering {ordering}"
        );
        // Too many due events to probe cheaply.
        assert_eq!(store.in_flight(5).await.unwrap(), None);
        // An explicit release returns once the claim's locks are gone (a dropped
        // claim is rolled back only when its connection is next used).
        claim.release().await.unwrap();
        assert_eq!(
            store.in_flight(100).await.unwrap(),
            Some(0),
            "ordering {ordering}"
        );
        db.drop_schema().await.unwrap();
    }
}
