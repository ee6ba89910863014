//! Wake-up modes against the real PostgreSQL: an idle relay learns of new events
//! long before its poll interval, and only when there is something to claim.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{drained, event, fast_config, remaining};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{Claim, Relay, Store};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::{install_notify_trigger, remove_notify_trigger, StoreConfig, Wakeup};

const FOREVER: Duration = Duration::from_secs(3600);

async fn commit_one(db: &TestOutbox, n: usize) {
    let mut tx = db.pool.begin().await.unwrap();
    db.outbox.enqueue(&mut tx, &event("w", n)).await.unwrap();
    tx.commit().await.unwrap();
}

/// Wait with an hour-long timeout while events are committed every 100 ms; the
/// wait must end because of them (bounded at 20 s).
async fn wait_ends_on_commit(db: &TestOutbox, store: &pgoutbox_postgres::PgStore) {
    let waiting = tokio::spawn({
        let store = store.clone();
        async move { store.wait_for_events(FOREVER).await }
    });
    let started = Instant::now();
    let mut n = 0;
    while !waiting.is_finished() {
        assert!(started.elapsed() < Duration::from_secs(20), "never woken");
        commit_one(db, n).await;
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    waiting.await.unwrap();
}

#[tokio::test]
async fn adaptive_polling_is_the_default_and_wakes_on_a_commit() {
    let db = TestOutbox::new().await.unwrap();
    let store = db.store();
    assert_eq!(store.wakeup(), &Wakeup::adaptive());
    wait_ends_on_commit(&db, &store).await;
    db.drop_schema().await.unwrap();
}

/// Also proves the probe itself works: a probe that fails ends the wait at once
/// (the claim after it reports the error).
#[tokio::test]
async fn adaptive_polling_does_not_wake_for_events_not_due_yet() {
    for ordering in [true, false] {
        let db = TestOutbox::new().await.unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        let later = event("w", 0).not_before(chrono::Utc::now() + chrono::Duration::hours(1));
        db.outbox.enqueue(&mut tx, &later).await.unwrap();
        tx.commit().await.unwrap();
        let store = db
            .store()
            .with_config(pgoutbox_postgres::StoreConfig::default().ordering(ordering));
        let waited =
            tokio::time::timeout(Duration::from_millis(500), store.wait_for_events(FOREVER)).await;
        assert!(
            waited.is_err(),
            "woke up with nothing due (ordering {ordering})"
        );
        db.drop_schema().await.unwrap();
    }
}

#[tokio::test]
async fn notify_wakes_a_waiting_store_and_a_claim_consumes_the_wake_up() {
    let db = TestOutbox::new().await.unwrap();
    install_notify_trigger(&db.pool, &db.tables).await.unwrap();
    install_notify_trigger(&db.pool, &db.tables).await.unwrap(); // idempotent
    let store = db.store().with_wakeup(Wakeup::notify());
    wait_ends_on_commit(&db, &store).await;

    // Claim everything; with nothing new, the next wait does not end early.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let claim = store.claim(1000).await.unwrap();
    assert!(!claim.events().is_empty());
    claim.release().await.unwrap();
    let waited =
        tokio::time::timeout(Duration::from_millis(500), store.wait_for_events(FOREVER)).await;
    assert!(waited.is_err(), "woke up without a new commit");

    // A new commit ends the wait again.
    wait_ends_on_commit(&db, &store).await;
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn without_the_trigger_notify_mode_falls_back_to_the_poll_interval() {
    let db = TestOutbox::new().await.unwrap();
    install_notify_trigger(&db.pool, &db.tables).await.unwrap();
    remove_notify_trigger(&db.pool, &db.tables).await.unwrap();
    remove_notify_trigger(&db.pool, &db.tables).await.unwrap(); // idempotent
    let store = db.store().with_wakeup(Wakeup::notify());
    // Let the listener start, then commit: no notification comes.
    let _ = tokio::time::timeout(Duration::from_millis(300), store.wait_for_events(FOREVER)).await;
    commit_one(&db, 0).await;
    let waited =
        tokio::time::timeout(Duration::from_millis(500), store.wait_for_events(FOREVER)).await;
    assert!(waited.is_err(), "woke up without the trigger");
    // The poll interval still bounds the wait.
    tokio::time::timeout(
        Duration::from_secs(5),
        store.wait_for_events(Duration::from_millis(50)),
    )
    .await
    .unwrap();
    db.drop_schema().await.unwrap();
}

#[tokio::test]
async fn relays_with_an_hour_poll_interval_publish_new_events_in_every_mode() {
    for (wakeup, trigger) in [
        (Wakeup::adaptive(), false),
        (Wakeup::notify(), true),
        (
            Wakeup::Notify {
                url: Some(pgoutbox_postgres::testing::database_url()),
            },
            true,
        ),
    ] {
        let db = TestOutbox::new().await.unwrap();
        if trigger {
            install_notify_trigger(&db.pool, &db.tables).await.unwrap();
        }
        let store = db.store().with_wakeup(wakeup.clone());
        let publisher = Arc::new(RecordingPublisher::new());
        let relay = Relay::new(store, Arc::clone(&publisher))
            .with_config(fast_config().poll_interval(FOREVER));
        let produce = async {
            // The relay is idle by now: only its wake-up can bring it back.
            tokio::time::sleep(Duration::from_millis(300)).await;
            for n in 0..20 {
                commit_one(&db, n).await;
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            while publisher.published_ids().len() < 20 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        relay.run(produce).await;
        assert_eq!(publisher.published_ids().len(), 20, "{wakeup:?}");
        db.drop_schema().await.unwrap();
    }
}

#[tokio::test]
async fn synchronous_record_commits_still_drain() {
    let db = TestOutbox::new().await.unwrap();
    for n in 0..50 {
        commit_one(&db, n).await;
    }
    let store = db
        .store()
        .with_config(StoreConfig::default().synchronous_commit(true));
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(store, Arc::clone(&publisher)).with_config(fast_config());
    relay
        .run(drained(db.store(), Duration::from_secs(20)))
        .await;
    assert_eq!(publisher.published_ids().len(), 50);
    assert_eq!(remaining(&db).await, 0);
    db.drop_schema().await.unwrap();
}
