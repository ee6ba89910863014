//! End to end: events enqueued in PostgreSQL transactions reach a real JetStream consumer.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use common::NatsTarget;
use pgoutbox_core::testing::run_relay_while;
use pgoutbox_core::{NewEvent, Publisher, Relay, Store};
use pgoutbox_postgres::testing::{broker_relay_config, TestOutbox};
use pgoutbox_postgres::{DeadLetterFilter, DeadLetters};
use uuid::Uuid;

const DEADLINE: Duration = Duration::from_secs(60);

/// Run `relay` while `work` runs, then shut it down gracefully; bounded by [`DEADLINE`].
async fn with_relay<S: Store, P: Publisher, T>(
    relay: &Relay<S, P>,
    work: impl Future<Output = T>,
) -> T {
    run_relay_while(relay, work, DEADLINE)
        .await
        .expect("test did not finish in time")
}

async fn enqueue(test: &TestOutbox, events: &[NewEvent]) {
    test.enqueue_committed(events).await.expect("enqueue");
}

/// Fetch until every id in `ids` was received; returns how often each id came.
async fn receive_all(target: &NatsTarget, ids: &[Uuid]) -> (Vec<Uuid>, HashMap<Uuid, usize>) {
    let wanted: HashSet<Uuid> = ids.iter().copied().collect();
    let mut order = Vec::new();
    let mut counts: HashMap<Uuid, usize> = HashMap::new();
    let deadline = Instant::now() + DEADLINE;
    while !wanted.iter().all(|id| counts.contains_key(id)) {
        assert!(
            Instant::now() < deadline,
            "not all events arrived: {counts:?}"
        );
        for message in target.fetch(100, Duration::from_millis(500)).await {
            order.push(message.id());
            *counts.entry(message.id()).or_default() += 1;
        }
    }
    (order, counts)
}

async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn republished_event_is_a_server_duplicate_and_consumed_once() {
    let test = TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL");
    let target = NatsTarget::new().await;
    let publisher = target
        .config(&common::nats_url())
        .connect()
        .await
        .expect("connect");
    let relay = Relay::new(test.store(), publisher).with_config(broker_relay_config());

    let event = NewEvent::new(
        "order",
        "42",
        "order.paid",
        &serde_json::json!({"total": 10}),
    );
    enqueue(&test, std::slice::from_ref(&event)).await;
    let first = relay.run_once().await.expect("relay");
    assert_eq!(first.published, 1);
    assert_eq!(relay.publisher().duplicates(), 0);

    // A relay that crashed after publishing but before recording publishes it again:
    // the same event (same id) is due once more.
    enqueue(&test, std::slice::from_ref(&event)).await;
    let second = relay.run_once().await.expect("relay");
    assert_eq!(
        second.published, 1,
        "a duplicate PubAck counts as published"
    );
    assert_eq!(
        relay.publisher().duplicates(),
        1,
        "the server must report the duplicate"
    );
    assert_eq!(
        target.stored().await,
        1,
        "JetStream must store the message once"
    );

    let (_, counts) = receive_all(&target, &[event.id]).await;
    assert_eq!(counts.get(&event.id), Some(&1));
    let more = target.fetch(10, Duration::from_millis(300)).await;
    assert!(
        more.is_empty(),
        "consumer got more: {:?}",
        more.iter().map(|m| m.id()).collect::<Vec<_>>()
    );
    target.delete().await;
    test.drop_schema().await.expect("drop schema");
}

#[tokio::test]
async fn oversize_payload_is_a_dead_letter_and_others_flow() {
    let test = TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL");
    let target = NatsTarget::new().await;
    let publisher = target
        .config(&common::nats_url())
        .connect()
        .await
        .expect("connect");
    let relay = Relay::new(test.store(), publisher).with_config(broker_relay_config());

    let big = NewEvent::new(
        "order",
        "big",
        "order.created",
        &serde_json::json!({"blob": "x".repeat(1_200_000)}),
    );
    let mut events = vec![big.clone()];
    events.extend((0..5).map(|i| {
        NewEvent::new(
            "order",
            format!("o-{i}"),
            "order.created",
            &serde_json::json!({"i": i}),
        )
    }));
    enqueue(&test, &events).await;
    let good: Vec<Uuid> = events[1..].iter().map(|e| e.id).collect();
    let dead = DeadLetters::new(test.pool.clone(), &test.outbox);

    let counts = with_relay(&relay, async {
        let counts = receive_all(&target, &good).await.1;
        wait_until("the dead letter", || async {
            dead.count(&DeadLetterFilter::default())
                .await
                .expect("count")
                == 1
        })
        .await;
        counts
    })
    .await;

    assert!(!counts.contains_key(&big.id));
    let letter = dead
        .show(big.id)
        .await
        .expect("show")
        .expect("dead letter of the big event");
    let error = letter.last_error.unwrap_or_default();
    assert!(
        error.contains("permanent") && error.contains("max payload"),
        "last error: {error}"
    );
    assert_eq!(
        letter.event.attempts, 1,
        "a permanent failure is not retried"
    );
    assert_eq!(relay.store().pending().await.expect("pending"), 0);
    target.delete().await;
    test.drop_schema().await.expect("drop schema");
}
