//! The delivery promises against the real PostgreSQL: backoff, dead letters,
//! poison isolation, per-aggregate order, crash safety, delayed delivery.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{
    drained, event, fast_config, fill, first_publishes_in_order, head_and_follower, remaining,
    run_all_until_drained, FlakyPublisher,
};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{Event, NewEvent, Outcome, PublishError, Publisher, Relay, RetryPolicy, Store};
use pgoutbox_postgres::testing::{retries, TestOutbox};
use pgoutbox_postgres::{DeadLetterFilter, DeadLetters, PgStore};
use uuid::Uuid;

async fn row_state(db: &TestOutbox, id: Uuid) -> (i32, Option<String>, bool, DateTime<Utc>) {
    sqlx::query_as(&format!(
        "SELECT attempts, last_error, dead_at IS NOT NULL, available_at FROM {}.outbox_events WHERE id = $1",
        db.tables.schema().quoted()
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn failing_event_waits_for_its_retry_time_then_dead_letters_with_its_last_error() {
    let db = TestOutbox::new().await.unwrap();
    let id = db.enqueue_committed(&[event("a", 0)]).await.unwrap()[0];

    let attempt = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&attempt);
    let publisher = RecordingPublisher::failing_when(move |_| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        Some(PublishError::retryable(format!("broker unavailable #{n}")))
    });
    let relay =
        Relay::new(db.store(), publisher).with_config(fast_config().retry(retries(3, 400..=400)));

    for expected_attempts in 1..=2 {
        let failed_at = Utc::now();
        assert_eq!(relay.run_once().await.unwrap().retried, 1);
        let (attempts, error, dead, available_at) = row_state(&db, id).await;
        assert_eq!((attempts, dead), (expected_attempts, false));
        assert_eq!(
            error.unwrap(),
            format!("broker unavailable #{expected_attempts}")
        );
        // Equal jitter: at least half the 400 ms delay.
        assert!(available_at >= failed_at + chrono::Duration::milliseconds(200));
        // Not claimable before its retry time...
        assert_eq!(relay.run_once().await.unwrap().claimed, 0);
        // ...and claimable once it has passed.
        tokio::time::sleep((available_at - Utc::now()).to_std().unwrap_or_default()).await;
    }
    let last = relay.run_once().await.unwrap();
    assert_eq!(last.dead_lettered, 1);
    let (attempts, error, dead, _) = row_state(&db, id).await;
    assert_eq!((attempts, dead), (3, true));
    assert_eq!(
        error.unwrap(),
        "gave up after 3 attempts: broker unavailable #3"
    );
    // A dead letter is not claimed again.
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn permanent_error_dead_letters_on_the_first_attempt() {
    let db = TestOutbox::new().await.unwrap();
    let id = db.enqueue_committed(&[event("a", 0)]).await.unwrap()[0];
    let publisher =
        RecordingPublisher::failing_when(|_| Some(PublishError::permanent("payload too large")));
    let relay = Relay::new(db.store(), publisher).with_config(fast_config());
    assert_eq!(relay.run_once().await.unwrap().dead_lettered, 1);
    let (attempts, error, dead, _) = row_state(&db, id).await;
    assert_eq!((attempts, dead), (1, true));
    assert_eq!(error.unwrap(), "permanent: payload too large");
    let dl = DeadLetters::new(db.pool.clone(), &db.outbox);
    let listed = dl.list(&DeadLetterFilter::default(), 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].event.id, id);
    db.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_events_end_dead_and_all_healthy_events_are_published() {
    let db = TestOutbox::new().await.unwrap();
    let ids = fill(&db, 200, 5).await;
    // 1% poison, spread over the backlog (some are heads of their aggregate).
    let poison: HashSet<Uuid> = ids.iter().step_by(100).copied().collect();
    assert_eq!(poison.len(), 10);
    let rule = poison.clone();
    let publisher = Arc::new(RecordingPublisher::failing_when(move |e| {
        rule.contains(&e.id)
            .then(|| PublishError::retryable("handler rejects this event"))
    }));
    let mut config = fast_config();
    config.retry = config.retry.max_attempts(4);
    // Release: the followers of a poison event go on (the default, Block, would keep
    // them pending until an operator acts; `dead_letter_releases_or_blocks_...`).
    let store = || {
        db.store().with_config(
            pgoutbox_postgres::StoreConfig::default()
                .after_dead_letter(pgoutbox_postgres::AfterDeadLetter::Release),
        )
    };
    let relays: Vec<_> = (0..2)
        .map(|_| Relay::new(store(), Arc::clone(&publisher)).with_config(config.clone()))
        .collect();
    run_all_until_drained(&relays, &db, Duration::from_secs(60)).await;

    let published: HashSet<Uuid> = publisher.published_ids().into_iter().collect();
    let healthy: HashSet<Uuid> = ids
        .iter()
        .copied()
        .filter(|id| !poison.contains(id))
        .collect();
    assert_eq!(published, healthy);
    let dead: HashSet<Uuid> = DeadLetters::new(db.pool.clone(), &db.outbox)
        .list(&DeadLetterFilter::default(), 100)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.event.id)
        .collect();
    assert_eq!(dead, poison);
    db.drop_schema().await.unwrap();
}

/// Four relays drain `aggregates` x `per_aggregate` events through a publisher
/// failing 10% of publishes; the first successful publishes of every aggregate
/// come in insertion order and nothing is lost.
async fn four_relays_keep_order(aggregates: usize, per_aggregate: usize) {
    let db = TestOutbox::new().await.unwrap();
    let ids = fill(&db, aggregates, per_aggregate).await;
    let publisher = Arc::new(FlakyPublisher::default());
    let relays: Vec<_> = (0..4)
        .map(|_| {
            Relay::new(db.store(), Arc::clone(&publisher))
                .with_config(fast_config().batch_size(200))
        })
        .collect();
    run_all_until_drained(&relays, &db, Duration::from_secs(240)).await;
    assert_eq!(remaining(&db).await, 0, "not drained in time");

    // The sequence of first successful publishes per aggregate is the insertion order.
    let per_aggregate_seqs = first_publishes_in_order(&publisher.log.lock().unwrap());
    let seen: usize = per_aggregate_seqs.values().map(Vec::len).sum();
    assert_eq!(seen, ids.len(), "every event published");
    assert_eq!(per_aggregate_seqs.len(), aggregates);
    for seqs in per_aggregate_seqs.values() {
        assert_eq!(seqs.len(), per_aggregate);
    }
    let held_back: u64 = relays.iter().map(|r| r.stats().snapshot().held_back).sum();
    assert!(
        held_back > 0,
        "failures inside runs held their followers back"
    );
    db.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_keep_per_aggregate_order_through_random_failures() {
    four_relays_keep_order(50, 400).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_keep_the_order_of_one_hot_aggregate_through_random_failures() {
    four_relays_keep_order(1, 5000).await;
}

#[tokio::test]
async fn failing_head_delays_its_own_aggregate_only() {
    let db = TestOutbox::new().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let x: Vec<Uuid> = db
        .outbox
        .enqueue_many(&mut tx, &[event("x", 0), event("x", 1), event("x", 2)])
        .await
        .unwrap();
    let y: Vec<Uuid> = db
        .outbox
        .enqueue_many(&mut tx, &[event("y", 0), event("y", 1), event("y", 2)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let head = x[0];
    let publisher = Arc::new(RecordingPublisher::failing_when(move |e| {
        (e.id == head).then(|| PublishError::retryable("down for x"))
    }));
    let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(
        fast_config().retry(RetryPolicy::default().base_delay(Duration::from_secs(60))),
    );
    for _ in 0..5 {
        relay.run_once().await.unwrap();
    }
    assert_eq!(publisher.published_ids(), y, "y flows while x is held back");
    assert_eq!(
        db.store().pending().await.unwrap(),
        3,
        "x's three events wait"
    );
    let stats = db.store().stats().await.unwrap();
    assert_eq!(
        (stats.held_aggregates, stats.scheduled),
        (1, 1),
        "x is held, its head scheduled"
    );
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn dead_letter_releases_or_blocks_its_followers_as_configured() {
    use pgoutbox_postgres::AfterDeadLetter;
    for policy in [AfterDeadLetter::Release, AfterDeadLetter::Block] {
        let (db, store, [head, follower]) = head_and_follower(policy).await;
        let publisher = RecordingPublisher::failing_when(move |e| {
            (e.id == head).then(|| PublishError::permanent("unroutable"))
        });
        let relay = Relay::new(store, publisher).with_config(fast_config());
        relay.run_once().await.unwrap();
        relay.run_once().await.unwrap();
        let published = relay.publisher().published_ids();
        match policy {
            AfterDeadLetter::Release => assert_eq!(published, vec![follower]),
            AfterDeadLetter::Block => {
                assert!(published.is_empty());
                // An operator purges the dead letter: the aggregate flows again.
                let dl = DeadLetters::new(db.pool.clone(), &db.outbox);
                assert_eq!(dl.purge(&DeadLetterFilter::id(head)).await.unwrap(), 1);
                relay.run_once().await.unwrap();
                assert_eq!(relay.publisher().published_ids(), vec![follower]);
            }
        }
        db.drop_schema().await.unwrap();
    }
}

/// Records every publish; the "crash" happens after it returns, before the record.
struct SlowRecorder {
    log: Mutex<Vec<Uuid>>,
}

impl Publisher for SlowRecorder {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.log.lock().unwrap().extend(events.iter().map(|e| e.id));
        // Widen the window between publish and record, where the kills land.
        tokio::time::sleep(Duration::from_millis(30)).await;
        vec![Outcome::Published; events.len()]
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_killed_between_publish_and_record_lose_nothing() {
    let db = TestOutbox::new().await.unwrap();
    let ids = fill(&db, 1000, 3).await;
    let batch_size = 50;
    let publisher = Arc::new(SlowRecorder {
        log: Mutex::default(),
    });
    let mut relays = Vec::new();
    for n in 0..3 {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(
                pgoutbox_postgres::testing::database_url()
                    .parse::<sqlx::postgres::PgConnectOptions>()
                    .unwrap()
                    .application_name(&format!("{}_relay{n}", db.tables.schema())),
            )
            .await
            .unwrap();
        let store = PgStore::new(pool, db.tables.clone());
        relays.push(
            Relay::new(store, Arc::clone(&publisher))
                .with_config(fast_config().batch_size(batch_size)),
        );
    }
    // Kill the connection of whichever relay is between claim and record
    // ("idle in transaction": it is publishing), again and again.
    let kills = Arc::new(AtomicU64::new(0));
    let killer = {
        let (pool, kills, prefix) = (
            db.pool.clone(),
            Arc::clone(&kills),
            db.tables.schema().to_string(),
        );
        async move {
            for _ in 0..40 {
                tokio::time::sleep(Duration::from_millis(25)).await;
                let killed: Vec<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name LIKE $1 || '_relay%' AND state = 'idle in transaction'",
                )
                .bind(&prefix)
                .fetch_all(&pool)
                .await
                .unwrap();
                kills.fetch_add(
                    killed.iter().filter(|k| **k).count() as u64,
                    Ordering::SeqCst,
                );
            }
        }
    };
    let run = run_all_until_drained(&relays, &db, Duration::from_secs(120));
    tokio::join!(killer, run);

    let log = publisher.log.lock().unwrap().clone();
    let unique: HashSet<Uuid> = log.iter().copied().collect();
    let kills = kills.load(Ordering::SeqCst);
    assert!(
        kills >= 5,
        "the test must actually kill relays, killed {kills}"
    );
    assert_eq!(remaining(&db).await, 0);
    assert_eq!(
        unique,
        ids.iter().copied().collect::<HashSet<_>>(),
        "events lost"
    );
    let duplicates = log.len() - unique.len();
    eprintln!(
        "crash test: {kills} kills, {duplicates} duplicates, {} events",
        ids.len()
    );
    assert!(
        duplicates > 0,
        "kills after publish must cause re-publishes"
    );
    assert!(
        duplicates as u64 <= kills * batch_size as u64,
        "{duplicates} duplicates for {kills} kills of batches of {batch_size}"
    );
    db.drop_schema().await.unwrap();
}

/// Logs when each event was published.
struct TimedPublisher {
    log: Mutex<Vec<(Uuid, DateTime<Utc>)>>,
}

impl TimedPublisher {
    /// Relay `db`'s events to a new one until nothing is pending (at most 10 s);
    /// returns its log: each event's id and when it was published, in order.
    async fn drain(db: &TestOutbox) -> Vec<(Uuid, DateTime<Utc>)> {
        let publisher = Arc::new(Self {
            log: Mutex::default(),
        });
        let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config());
        relay
            .run(drained(db.store(), Duration::from_secs(10)))
            .await;
        let log = publisher.log.lock().unwrap().clone();
        log
    }
}

impl Publisher for TimedPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let now = Utc::now();
        self.log
            .lock()
            .unwrap()
            .extend(events.iter().map(|e| (e.id, now)));
        vec![Outcome::Published; events.len()]
    }
}

#[tokio::test]
async fn delayed_event_is_not_published_before_its_time() {
    let db = TestOutbox::new().await.unwrap();
    let not_before = Utc::now() + chrono::Duration::seconds(2);
    let mut tx = db.pool.begin().await.unwrap();
    let delayed = db
        .outbox
        .enqueue(&mut tx, &event("a", 0).not_before(not_before))
        .await
        .unwrap();
    let now = db.outbox.enqueue(&mut tx, &event("b", 0)).await.unwrap();
    tx.commit().await.unwrap();

    let log = TimedPublisher::drain(&db).await;
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].0, now);
    assert_eq!(log[1].0, delayed);
    assert!(
        log[1].1 >= not_before,
        "published at {} before {not_before}",
        log[1].1
    );
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn enqueue_with_a_delay_and_ordering_keeps_followers_behind() {
    let db = TestOutbox::new().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let first = db
        .outbox
        .enqueue(
            &mut tx,
            &event("a", 0).not_before(Utc::now() + chrono::Duration::milliseconds(500)),
        )
        .await
        .unwrap();
    let second = db
        .outbox
        .enqueue(
            &mut tx,
            &NewEvent::new("order", "a", "order.paid", &serde_json::json!({})),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let order: Vec<Uuid> = TimedPublisher::drain(&db)
        .await
        .iter()
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(order, vec![first, second]);
    db.drop_schema().await.unwrap();
}

/// A claim's walk may start past the oldest events (to skip index entries of
/// published rows), but never past an aggregate whose events wait behind a hold:
/// after a hold on 20 events is lifted, which releases only the first 16, a new
/// event of the aggregate still goes out after the other four.
#[tokio::test]
async fn a_lifted_hold_keeps_its_aggregate_in_order_behind_later_traffic() {
    let db = TestOutbox::new().await.unwrap();
    let x: Vec<NewEvent> = (0..20).map(|n| event("x", n)).collect();
    let mut x_ids = db.enqueue_committed(&x).await.unwrap();
    db.enqueue_committed(&[event("y", 0)]).await.unwrap();
    let head = x_ids[0];
    let publisher = Arc::new(RecordingPublisher::failing_once(
        head,
        "first attempt fails",
    ));
    let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(
        fast_config().retry(
            RetryPolicy::default()
                .base_delay(Duration::from_millis(300))
                .max_delay(Duration::from_millis(300)),
        ),
    );
    // x's head fails and holds x; y goes out.
    relay.run_once().await.unwrap();
    // Traffic after x while x is held: the walk moves on.
    db.enqueue_committed(&[event("z", 0)]).await.unwrap();
    relay.run_once().await.unwrap();
    // The hold expires: x's first events go out, the rest stays pending.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !publisher.published_ids().contains(&head) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "x's head never retried"
        );
        relay.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    x_ids.extend(db.enqueue_committed(&[event("x", 20)]).await.unwrap());
    while publisher.published_ids().len() < x_ids.len() + 2 {
        assert!(tokio::time::Instant::now() < deadline, "not drained");
        relay.run_once().await.unwrap();
    }
    let x_order: Vec<Uuid> = publisher
        .published_ids()
        .into_iter()
        .filter(|id| x_ids.contains(id))
        .collect();
    assert_eq!(x_order, x_ids, "x in insertion order");
    db.drop_schema().await.unwrap();
}

/// An event whose transaction took its `seq` before others committed, and
/// committed after a claim had moved past them, still goes out before its
/// aggregate's later events.
#[tokio::test]
async fn a_late_commit_goes_out_before_its_aggregates_later_events() {
    let db = TestOutbox::new().await.unwrap();
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config());
    // x's first event: inserted, not committed yet.
    let mut late = db.pool.begin().await.unwrap();
    let early_x = db.outbox.enqueue(&mut late, &event("x", 0)).await.unwrap();
    // Later traffic of another aggregate commits and is published.
    let y = db.enqueue_committed(&[event("y", 0)]).await.unwrap();
    relay.run_once().await.unwrap();
    assert_eq!(publisher.published_ids(), y);
    // The late commit, then x's next event.
    late.commit().await.unwrap();
    let next_x = db.enqueue_committed(&[event("x", 1)]).await.unwrap()[0];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while publisher.published_ids().len() < 3 {
        assert!(tokio::time::Instant::now() < deadline, "x not published");
        relay.run_once().await.unwrap();
    }
    let published = publisher.published_ids();
    assert_eq!(&published[1..], &[early_x, next_x], "x in insertion order");
    db.drop_schema().await.unwrap();
}
