//! Claims while another session holds back the xmin horizon (pg_dump, a long
//! report, an idle client, a replica's `hot_standby_feedback`): vacuum may not
//! remove what that snapshot could still see, so the index entries of every event
//! published meanwhile stay. A claim must never step over them: its walk starts
//! past them, whatever else is held, backing off or delayed.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    event, fast_config, fill, first_publishes_in_order, run_all_until_drained, saved_walk_start,
    spawn_until_stopped, FlakyPublisher,
};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{DeadLetterFilter, PublishError, Publisher, Relay, RetryPolicy, Store};
use pgoutbox_postgres::testing::{database_url, TestOutbox};
use pgoutbox_postgres::{migrate, DeadLetters, PgStore};
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;
use uuid::Uuid;

/// A session holding a snapshot, as `pg_dump` does: `REPEATABLE READ`, one query
/// run, the transaction left open until the connection is dropped.
async fn hold_snapshot() -> PgConnection {
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// The newest `seq` handed out (published events included).
async fn newest_seq(db: &TestOutbox) -> i64 {
    sqlx::query_scalar("SELECT last_value FROM pg_sequences WHERE schemaname = $1")
        .bind(db.tables.schema().as_str())
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// `VACUUM` of the events table, as autovacuum would run it (it is off on the
/// test machines): with a snapshot held, it removes nothing that snapshot may see.
async fn vacuum(db: &TestOutbox) {
    sqlx::raw_sql(&format!(
        "VACUUM {}.outbox_events",
        db.tables.schema().quoted()
    ))
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Run `relay` once at a time until `done` holds, committing one event of a
/// live aggregate before each claim (traffic goes on); at most `limit`.
async fn claim_with_traffic<P: Publisher>(
    db: &TestOutbox,
    relay: &Relay<PgStore, P>,
    limit: Duration,
    what: &str,
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + limit;
    let mut n = 0;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        db.enqueue_committed(&[event("live", n)]).await.unwrap();
        n += 1;
        relay.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Claim with traffic until `store`'s walk start has passed every event committed
/// so far (at most 20 s).
async fn walk_start_passes_everything_so_far<P: Publisher>(
    db: &TestOutbox,
    store: &PgStore,
    relay: &Relay<PgStore, P>,
) {
    let last = newest_seq(db).await;
    claim_with_traffic(
        db,
        relay,
        Duration::from_secs(20),
        "the walk start passed every event committed before",
        || store.walk_start() > last,
    )
    .await;
}

/// With a snapshot held (the holding session is returned), publish 10,000 events
/// (20 aggregates) with a relay, traffic going on, until its walk start has passed
/// all of them; then `VACUUM`, which removes none of their entries: the held
/// snapshot may see them.
async fn publish_ten_thousand() -> (
    TestOutbox,
    PgConnection,
    PgStore,
    Relay<PgStore, RecordingPublisher>,
) {
    let db = TestOutbox::new().await.unwrap();
    let holder = hold_snapshot().await;
    let store = db.store();
    let relay = Relay::new(store.clone(), RecordingPublisher::new()).with_config(fast_config());
    let ids = fill(&db, 20, 500).await;
    claim_with_traffic(
        &db,
        &relay,
        Duration::from_secs(60),
        "10,000 events published",
        || relay.publisher().published_ids().len() >= ids.len(),
    )
    .await;
    walk_start_passes_everything_so_far(&db, &store, &relay).await;
    vacuum(&db).await;
    (db, holder, store, relay)
}

/// A claim's walk and the wake-up probe from `walk_start` read a few pages, where a
/// walk from the beginning reads the entries of every published event.
async fn few_pages_from(db: &TestOutbox, walk_start: i64, whose: &str) {
    let (from_beginning, _) = db.walk_buffers(i64::MIN).await.unwrap();
    assert!(
        from_beginning > 200,
        "a walk from the beginning read only {from_beginning} pages: the published \
         events' entries are gone, the test shows nothing"
    );
    let (walk, probe) = db.walk_buffers(walk_start).await.unwrap();
    assert!(
        walk < 30 && probe < 30,
        "from {whose} walk start, a claim's walk read {walk} pages and the probe {probe} \
         (from the beginning: {from_beginning})"
    );
}

/// The walk start passes the events published while a snapshot is held, so that a
/// claim and a wake-up probe read a few pages, not the index entries of every one
/// of them. (Before, the start waited for every running transaction, the snapshot
/// holder's too: it stayed below them for as long as the snapshot was held.)
#[tokio::test]
async fn claims_step_over_no_published_event_while_a_snapshot_is_held() {
    let (db, holder, store, _relay) = publish_ten_thousand().await;
    few_pages_from(&db, store.walk_start(), "the relay's").await;
    drop(holder);
    db.drop_schema().await.unwrap();
}

/// A relay that starts while a snapshot is held (a deploy during pg_dump, a restart
/// after a crash) walks from the start the running relays saved: its first claim
/// reads a few pages, not the index entries of every event published since the
/// snapshot was taken. (Before, a new relay walked from the beginning until its own
/// observations moved its start, over all of them on every claim.)
#[tokio::test]
async fn a_relay_started_while_a_snapshot_is_held_walks_from_the_saved_start() {
    let (db, holder, store, relay) = publish_ten_thousand().await;
    let passed = store.walk_start();
    // Saves are made by claims, at most every few seconds.
    let deadline = Instant::now() + Duration::from_secs(30);
    while saved_walk_start(&db).await.unwrap_or(i64::MIN) < passed {
        assert!(Instant::now() < deadline, "the walk start was not saved");
        db.enqueue_committed(&[event("live", 0)]).await.unwrap();
        relay.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let later = db.store();
    let later_relay =
        Relay::new(later.clone(), RecordingPublisher::new()).with_config(fast_config());
    let next = db.enqueue_committed(&[event("after", 0)]).await.unwrap()[0];
    later_relay.run_once().await.unwrap();
    assert_eq!(later_relay.publisher().published_ids(), vec![next]);
    assert!(
        later.walk_start() >= passed,
        "the new relay walks from {} (the running relay from {passed})",
        later.walk_start()
    );
    few_pages_from(&db, later.walk_start(), "the new relay's").await;
    drop(holder);
    db.drop_schema().await.unwrap();
}

/// Events that wait (a dead letter's followers, a delayed event, a retry backing
/// off) keep the walk start back no more than published ones: their aggregates are
/// held, and found again through the holds table. A retried dead letter then goes
/// out first, its followers after it in order, however far behind the start they
/// are; the pending count still counts every waiting event.
#[tokio::test]
async fn held_aggregates_do_not_keep_the_walk_back_while_a_snapshot_is_held() {
    let db = TestOutbox::new().await.unwrap();
    let holder = hold_snapshot().await;
    let in_an_hour = chrono::Utc::now() + chrono::Duration::hours(1);
    let x = db
        .enqueue_committed(&[event("x", 0), event("x", 1), event("x", 2), event("x", 3)])
        .await
        .unwrap();
    let y = db
        .enqueue_committed(&[event("y", 0).not_before(in_an_hour), event("y", 1)])
        .await
        .unwrap();
    let z = db
        .enqueue_committed(&[event("z", 0), event("z", 1)])
        .await
        .unwrap();
    let refuse_x = Arc::new(AtomicBool::new(true));
    let refusing = Arc::clone(&refuse_x);
    let (x_head, z_head) = (x[0], z[0]);
    let publisher = Arc::new(RecordingPublisher::failing_when(move |e| {
        if e.id == x_head && refusing.load(Ordering::SeqCst) {
            Some(PublishError::permanent("unroutable"))
        } else if e.id == z_head {
            Some(PublishError::retryable("throttled"))
        } else {
            None
        }
    }));
    let store = db.store();
    let relay = Relay::new(store.clone(), Arc::clone(&publisher)).with_config(
        fast_config().retry(RetryPolicy::default().base_delay(Duration::from_secs(3600))),
    );
    relay.run_once().await.unwrap();
    assert!(publisher.published_ids().is_empty(), "x, y and z all wait");

    let ids = fill(&db, 10, 400).await;
    let published: HashSet<Uuid> = ids.iter().copied().collect();
    claim_with_traffic(
        &db,
        &relay,
        Duration::from_secs(60),
        "4,000 events published",
        || {
            let seen: HashSet<Uuid> = publisher.published_ids().into_iter().collect();
            published.is_subset(&seen)
        },
    )
    .await;
    walk_start_passes_everything_so_far(&db, &store, &relay).await;
    let waiting = (x.len() - 1 + y.len() + z.len()) as u64;
    // Claims took everything else (the live events of `claim_with_traffic` too).
    relay.run_once().await.unwrap();
    assert_eq!(
        store.pending().await.unwrap(),
        waiting,
        "x's followers, y and z wait"
    );
    let (walk, probe) = db.walk_buffers(store.walk_start()).await.unwrap();
    assert!(walk < 30 && probe < 30, "walk {walk}, probe {probe} pages");

    // The operator retries x's dead letter: x goes out in order, y and z wait on.
    refuse_x.store(false, Ordering::SeqCst);
    let dead_letters = DeadLetters::new(db.pool.clone(), &db.outbox);
    assert_eq!(
        dead_letters
            .retry(&DeadLetterFilter::id(x_head))
            .await
            .unwrap(),
        1
    );
    claim_with_traffic(
        &db,
        &relay,
        Duration::from_secs(20),
        "x published after its retry",
        || publisher.published_ids().contains(&x[3]),
    )
    .await;
    let order: Vec<Uuid> = publisher
        .published_ids()
        .into_iter()
        .filter(|id| x.contains(id))
        .collect();
    assert_eq!(
        order, x,
        "x's dead letter first, then its followers in order"
    );
    let seen: HashSet<Uuid> = publisher.published_ids().into_iter().collect();
    assert!(
        !y.iter().chain(&z).any(|id| seen.contains(id)),
        "y (delayed) and z (backing off) still wait"
    );
    assert_eq!(store.pending().await.unwrap(), (y.len() + z.len()) as u64);
    drop(holder);
    db.drop_schema().await.unwrap();
}

/// The order promise with a snapshot held the whole time: four relays, 10% of
/// publishes failing (so aggregates are held, taken up again, held again, while
/// walk starts move past them), one hot aggregate among many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_keep_order_through_random_failures_while_a_snapshot_is_held() {
    let db = TestOutbox::new().await.unwrap();
    let holder = hold_snapshot().await;
    let mut ids = fill(&db, 30, 60).await;
    ids.extend(
        db.enqueue_many_committed(&(0..1500).map(|n| event("hot", n)).collect::<Vec<_>>())
            .await
            .unwrap(),
    );
    ids.extend(fill(&db, 30, 60).await);
    let publisher = Arc::new(FlakyPublisher::default());
    let relays: Vec<_> = (0..4)
        .map(|_| {
            Relay::new(db.store(), Arc::clone(&publisher))
                .with_config(fast_config().batch_size(100))
        })
        .collect();
    run_all_until_drained(&relays, &db, Duration::from_secs(240)).await;
    assert_eq!(common::remaining(&db).await, 0, "not drained in time");

    let per_aggregate = first_publishes_in_order(&publisher.log.lock().unwrap());
    let seen: usize = per_aggregate.values().map(Vec::len).sum();
    assert_eq!(seen, ids.len(), "every event published");
    let held_back: u64 = relays.iter().map(|r| r.stats().snapshot().held_back).sum();
    assert!(
        held_back > 0,
        "failures inside runs held their followers back"
    );
    drop(holder);
    db.drop_schema().await.unwrap();
}

/// An outbox of the previous release (migration 6: the holds table under its old
/// name, an aggregate held by an old relay) is migrated while producers commit and
/// relays of this version run: the relays fail their claims until the migration is
/// in, then publish every event once per id, each aggregate in insertion order, the
/// held one after its hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_migrated_while_producers_and_relays_run_loses_nothing() {
    let db = TestOutbox::migrated_to(6).await.unwrap();
    let mut ids = fill(&db, 10, 50).await;
    let held = db
        .enqueue_committed(&[event("held", 0), event("held", 1), event("held", 2)])
        .await
        .unwrap();
    ids.extend(&held);
    sqlx::query(&format!(
        "INSERT INTO {}.outbox_events_holds (aggregate_type, aggregate_id, until) \
         VALUES ('order', 'held', now() + interval '5 seconds')",
        db.tables.schema().quoted()
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let hold_ends = Instant::now() + Duration::from_secs(5);

    // Producers commit all along.
    let producing = Arc::new(AtomicBool::new(true));
    let produced = Arc::new(Mutex::new(Vec::new()));
    let producer = {
        let (db, producing, produced) = (db.clone(), Arc::clone(&producing), Arc::clone(&produced));
        tokio::spawn(async move {
            let mut n = 0;
            while producing.load(Ordering::SeqCst) {
                let event = event(&format!("p{}", n % 5), n);
                let id = db.enqueue_committed(&[event]).await.unwrap();
                produced.lock().unwrap().extend(id);
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let publisher = Arc::new(RecordingPublisher::new());
    let mut running = Vec::new();
    for _ in 0..2 {
        let relay = Relay::new(db.store(), Arc::clone(&publisher)).with_config(fast_config());
        running.push(spawn_until_stopped(|stopped| async move {
            relay.run(stopped).await;
        }));
    }
    // Until the migration, every claim fails: the held table is not there yet.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        publisher.published_ids().is_empty(),
        "nothing claimed before the migration"
    );
    migrate(&db.pool, &db.tables).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    if Instant::now() + Duration::from_secs(1) < hold_ends {
        let seen: HashSet<Uuid> = publisher.published_ids().into_iter().collect();
        assert!(!seen.is_empty(), "claims go on after the migration");
        assert!(
            !held.iter().any(|id| seen.contains(id)),
            "the aggregate an old relay held waits for its hold"
        );
    }
    producing.store(false, Ordering::SeqCst);
    producer.await.unwrap();
    ids.extend(produced.lock().unwrap().iter().copied());

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: HashSet<Uuid> = publisher.published_ids().into_iter().collect();
        if ids.iter().all(|id| seen.contains(id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every event published within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (stop, run) in running {
        let _ = stop.send(());
        run.await.unwrap();
    }

    let published = publisher.published();
    let per_aggregate = first_publishes_in_order(&published);
    let first: usize = per_aggregate.values().map(Vec::len).sum();
    assert_eq!(first, published.len(), "an event was published twice");
    assert_eq!(db.store().pending().await.unwrap(), 0);
    db.drop_schema().await.unwrap();
}
