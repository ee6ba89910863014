//! Where ordered claims start walking the pending index: past published events
//! once PostgreSQL shows it safe, never past an event that may still appear.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{event, fast_config, fill, head_and_follower, saved_walk_start};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{PublishError, Relay, Store};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::{AfterDeadLetter, DeadLetterFilter, DeadLetters, PgStore};
use uuid::Uuid;

fn events_table(db: &TestOutbox) -> String {
    format!("{}.outbox_events", db.tables.schema().quoted())
}

async fn seq_of(db: &TestOutbox, id: Uuid) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT seq FROM {} WHERE id = $1",
        events_table(db)
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Traffic on aggregates of its own, published by `relay`, for `rounds` rounds or,
/// with `until_past`, until the store's walk start is past that `seq` (at most 30 s).
async fn traffic(
    db: &TestOutbox,
    relay: &Relay<PgStore, RecordingPublisher>,
    store: &PgStore,
    rounds: usize,
    until_past: Option<i64>,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for round in 0.. {
        if let Some(seq) = until_past {
            if store.walk_start() > seq {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the walk start stayed at {} (not past {seq})",
                store.walk_start()
            );
        } else if round == rounds {
            return;
        }
        db.enqueue_committed(&[event(&format!("traffic{round}"), 0)])
            .await
            .unwrap();
        relay.run_once().await.unwrap();
        // Claims observe the front at most every 25 ms.
        tokio::time::sleep(Duration::from_millis(26)).await;
    }
}

/// The start relays saved for relays that start later (migration 9), once it is
/// at least `at_least` (at most 20 s, `traffic` meanwhile: saves are made by claims).
async fn saved_start(
    db: &TestOutbox,
    relay: &Relay<PgStore, RecordingPublisher>,
    store: &PgStore,
    at_least: i64,
) -> i64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let saved = saved_walk_start(db).await;
        if let Some(saved) = saved.filter(|saved| *saved >= at_least) {
            return saved;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no start of at least {at_least} saved (saved: {saved:?})"
        );
        traffic(db, relay, store, 1, None).await;
    }
}

#[tokio::test]
async fn the_walk_start_moves_past_published_events() {
    let db = TestOutbox::new().await.unwrap();
    let store = db.store();
    let relay = Relay::new(store.clone(), RecordingPublisher::new()).with_config(fast_config());
    let first = db.enqueue_committed(&[event("x", 0)]).await.unwrap()[0];
    let first_seq = seq_of(&db, first).await;
    assert_eq!(store.walk_start(), i64::MIN);
    traffic(&db, &relay, &store, 0, Some(first_seq)).await;
    assert!(relay.publisher().published_ids().contains(&first));
    db.drop_schema().await.unwrap();
}

/// Under a backlog the start keeps up with the drain: a claim observes the front
/// whenever the walk before it found its first row more than four claims' worth
/// of `seq`s past the start, not only every 25 ms. Paced by time alone, the start
/// trailed by every claim made in 25 ms (up to 19 claims here), and under a held
/// snapshot each of their events was a dead row that every claim visited. The
/// bound is counted in claims (the trigger's four, one that observes, one while
/// the observation is confirmed, one spare): it holds however fast or slow the
/// machine is.
#[tokio::test]
async fn a_drain_keeps_the_walk_start_within_a_few_claims_of_the_front() {
    let db = TestOutbox::new().await.unwrap();
    let store = db.store();
    let batch = 20;
    let relay = Relay::new(store.clone(), RecordingPublisher::new())
        .with_config(fast_config().batch_size(batch));
    fill(&db, 50, 40).await;
    let oldest_pending = format!(
        "SELECT min(seq) FROM {} WHERE processed_at IS NULL AND dead_at IS NULL",
        events_table(&db)
    );
    let mut trails = Vec::new();
    for claim in 0.. {
        relay.run_once().await.unwrap();
        let front: Option<i64> = sqlx::query_scalar(&oldest_pending)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let Some(front) = front else { break };
        // The first claims walk from the beginning until two observations agree.
        if claim >= 4 {
            trails.push(front.saturating_sub(store.walk_start()));
        }
    }
    assert_eq!(relay.publisher().published_ids().len(), 2000);
    let batch = i64::try_from(batch).unwrap();
    let worst = trails.iter().copied().max().unwrap();
    assert!(
        worst <= 7 * batch,
        "the start trailed the oldest pending event by up to {worst} seqs \
         (batches of {batch}); after each claim: {trails:?}"
    );
    db.drop_schema().await.unwrap();
}

/// A transaction that has taken a `seq` from the events table's sequence and has no
/// transaction id. `nextval` gets one when it writes the sequence's WAL record (on
/// first use, then every 32 values, and first after a checkpoint): a warm-up call
/// comes first, and a transaction that got an id anyway is tried again.
async fn seq_without_transaction_id(
    db: &TestOutbox,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, i64) {
    let nextval = "SELECT nextval(pg_get_serial_sequence($1, 'seq'))";
    for _ in 0..5 {
        let _: i64 = sqlx::query_scalar(nextval)
            .bind(events_table(db))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        let seq: i64 = sqlx::query_scalar(nextval)
            .bind(events_table(db))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let has_xid: bool =
            sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        if !has_xid {
            return (tx, seq);
        }
        tx.rollback().await.unwrap();
    }
    panic!("every nextval wrote WAL: no window without a transaction id to test");
}

/// A producer that has taken its `seq` but has written nothing yet has no
/// transaction id: only its virtual transaction id shows it is running. The walk
/// start must not pass its event, or the aggregate's next event would go first.
#[tokio::test]
async fn the_walk_start_waits_for_a_producer_that_took_its_seq_before_writing() {
    let db = TestOutbox::new().await.unwrap();
    let store = db.store();
    let relay = Relay::new(store.clone(), RecordingPublisher::new()).with_config(fast_config());
    let (mut late, late_seq) = seq_without_transaction_id(&db).await;

    // Later events are committed and published while the producer waits.
    traffic(&db, &relay, &store, 40, None).await;
    assert!(
        store.walk_start() <= late_seq,
        "walk start {} passed the running producer's seq {late_seq}",
        store.walk_start()
    );

    // The producer writes its event with the seq it took, and commits; then the
    // aggregate's next event.
    let late_id = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {} (seq, id, aggregate_type, aggregate_id, event_type, payload) \
         OVERRIDING SYSTEM VALUE VALUES ($1, $2, 'order', 'x', 'order.created', '{{}}')",
        events_table(&db)
    ))
    .bind(late_seq)
    .bind(late_id)
    .execute(&mut *late)
    .await
    .unwrap();
    late.commit().await.unwrap();
    let next = db.enqueue_committed(&[event("x", 1)]).await.unwrap()[0];

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let x_published = || {
        relay
            .publisher()
            .published_ids()
            .into_iter()
            .filter(|id| *id == late_id || *id == next)
            .collect::<Vec<_>>()
    };
    while x_published().len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "x not published: {:?}",
            x_published()
        );
        relay.run_once().await.unwrap();
    }
    assert_eq!(x_published(), vec![late_id, next], "x in insertion order");
    db.drop_schema().await.unwrap();
}

/// Retry the dead letter `head`, claim once, and the events of `ids` `relay` has
/// published, in publish order.
async fn retry_and_claim(
    db: &TestOutbox,
    relay: &Relay<PgStore, RecordingPublisher>,
    head: Uuid,
    ids: &[Uuid],
) -> Vec<Uuid> {
    let dead_letters = DeadLetters::new(db.pool.clone(), &db.outbox);
    assert_eq!(
        dead_letters
            .retry(&DeadLetterFilter::id(head))
            .await
            .unwrap(),
        1
    );
    relay.run_once().await.unwrap();
    relay
        .publisher()
        .published_ids()
        .into_iter()
        .filter(|id| ids.contains(id))
        .collect()
}

/// A retried dead letter goes back into the pending index below the walk start;
/// the next claim takes it up all the same, before its aggregate's followers.
#[tokio::test]
async fn a_dead_letter_retried_behind_the_walk_start_is_claimed_next_in_order() {
    for policy in [AfterDeadLetter::Release, AfterDeadLetter::Block] {
        let (db, store, ids) = head_and_follower(policy).await;
        let head = ids[0];
        let head_seq = seq_of(&db, head).await;
        let refuse = Arc::new(AtomicBool::new(true));
        let refusing = Arc::clone(&refuse);
        let publisher = RecordingPublisher::failing_when(move |e| {
            (e.id == head && refusing.load(Ordering::SeqCst))
                .then(|| PublishError::permanent("unroutable"))
        });
        let relay = Relay::new(store.clone(), publisher).with_config(fast_config());
        relay.run_once().await.unwrap();
        traffic(&db, &relay, &store, 0, Some(head_seq)).await;

        refuse.store(false, Ordering::SeqCst);
        let x = retry_and_claim(&db, &relay, head, &ids).await;
        match policy {
            // The follower went out when its head was dead-lettered.
            AfterDeadLetter::Release => assert_eq!(x, vec![ids[1], head]),
            AfterDeadLetter::Block => assert_eq!(x, ids, "head, then its follower"),
        }
        db.drop_schema().await.unwrap();
    }
}

/// A relay that starts later (a deploy, a restart) walks from the start the running
/// relays saved, not from the beginning; an aggregate held below it (a dead letter
/// that blocks its follower) still goes out, in order, once the dead letter is
/// retried.
#[tokio::test]
async fn a_relay_started_later_walks_from_the_saved_start_and_keeps_order() {
    let (db, store, ids) = head_and_follower(AfterDeadLetter::Block).await;
    let [head, follower] = ids;
    let follower_seq = seq_of(&db, follower).await;
    let publisher = RecordingPublisher::failing_when(move |e| {
        (e.id == head).then(|| PublishError::permanent("unroutable"))
    });
    let relay = Relay::new(store.clone(), publisher).with_config(fast_config());
    relay.run_once().await.unwrap();
    traffic(&db, &relay, &store, 0, Some(follower_seq)).await;
    let saved = saved_start(&db, &relay, &store, follower_seq + 1).await;
    assert!(!relay.publisher().published_ids().contains(&follower));

    let later = db.store().with_config(*store.config());
    let relay = Relay::new(later.clone(), RecordingPublisher::new()).with_config(fast_config());
    assert_eq!(later.walk_start(), i64::MIN);
    // The count of pending events a relay makes as it starts, beside its first
    // claim, reads the saved start too rather than walk from the beginning.
    let counting = db.store().with_config(*store.config());
    let pending = counting.pending().await.unwrap();
    assert!(
        counting.walk_start() >= saved,
        "the count walks from {} (saved: {saved})",
        counting.walk_start()
    );
    assert_eq!(pending, 1, "the follower, held below the start");
    // So do the operators' counts (`outbox stats`, the binary's gauges), with the
    // same result, the dead letter and its hold beside it.
    let operator = db.store().with_config(*store.config());
    let stats = operator.stats().await.unwrap();
    assert!(
        operator.walk_start() >= saved,
        "the stats walk from {} (saved: {saved})",
        operator.walk_start()
    );
    assert_eq!(
        (stats.pending, stats.dead_letters, stats.held_aggregates),
        (1, 1, 1),
        "{stats:?}"
    );
    relay.run_once().await.unwrap();
    assert!(
        later.walk_start() >= saved,
        "the new relay walks from {} (saved: {saved})",
        later.walk_start()
    );
    let published = retry_and_claim(&db, &relay, head, &ids).await;
    assert_eq!(published, ids, "the retried dead letter, then its follower");
    db.drop_schema().await.unwrap();
}

/// A saved start above the events' sequence was saved before the table's identity
/// was restarted (`TRUNCATE ... RESTART IDENTITY`): a relay that starts then
/// ignores it and publishes the new events at once.
#[tokio::test]
async fn a_saved_start_above_a_restarted_sequence_is_ignored() {
    let db = TestOutbox::new().await.unwrap();
    let store = db.store();
    let relay = Relay::new(store.clone(), RecordingPublisher::new()).with_config(fast_config());
    let first = db.enqueue_committed(&[event("x", 0)]).await.unwrap()[0];
    let first_seq = seq_of(&db, first).await;
    traffic(&db, &relay, &store, 0, Some(first_seq)).await;
    let saved = saved_start(&db, &relay, &store, first_seq + 1).await;
    sqlx::raw_sql(&format!("TRUNCATE {} RESTART IDENTITY", events_table(&db)))
        .execute(&db.pool)
        .await
        .unwrap();
    let fresh = db.enqueue_committed(&[event("y", 0)]).await.unwrap()[0];
    assert!(seq_of(&db, fresh).await < saved);

    let later = db.store();
    let relay = Relay::new(later.clone(), RecordingPublisher::new()).with_config(fast_config());
    relay.run_once().await.unwrap();
    assert_eq!(relay.publisher().published_ids(), vec![fresh]);
    db.drop_schema().await.unwrap();
}
