//! End to end: events enqueued in PostgreSQL transactions reach a real JetStream consumer.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use common::{nats_addr, NatsTarget};
use pgoutbox_core::conformance::proxy::TcpProxy;
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

fn events_table(test: &TestOutbox) -> String {
    format!(
        "{}.{}",
        test.tables.schema().quoted(),
        test.tables.events().quoted()
    )
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

/// A NATS outage longer than the whole retry schedule (3 attempts, 50-300 ms apart)
/// counts no attempt and makes no dead letter: the relay pauses, probes, and sends
/// everything in per-aggregate order once NATS is back. A message NATS refuses for
/// good during the same outage is dead-lettered alone.
#[tokio::test]
async fn an_outage_longer_than_the_retry_schedule_dead_letters_nothing() {
    let test = TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL");
    let target = NatsTarget::new().await;
    let proxy = TcpProxy::start(nats_addr()).expect("proxy");
    let url = format!("nats://{}", proxy.addr());
    let publisher = target
        .config(&url)
        .timeout(Duration::from_millis(700))
        .connect()
        .await
        .expect("connect through the proxy");
    publisher.check().await.expect("connected");
    let mut config = broker_relay_config();
    config.retry = config.retry.max_attempts(3);
    config.broker_probe_min = Duration::from_millis(100);
    config.broker_probe_max = Duration::from_millis(500);
    let relay = Relay::new(test.store(), publisher).with_config(config);
    let health = relay.broker_health();

    proxy.cut();
    // Two events on each of five orders, interleaved; and one too large for NATS.
    let events: Vec<NewEvent> = (0..10)
        .map(|i| {
            NewEvent::new(
                "order",
                format!("o-{}", i % 5),
                "order.changed",
                &serde_json::json!({"i": i}),
            )
        })
        .collect();
    let big = NewEvent::new(
        "order",
        "big",
        "order.created",
        &serde_json::json!({"blob": "x".repeat(1_200_000)}),
    );
    enqueue(&test, &events).await;
    enqueue(&test, std::slice::from_ref(&big)).await;
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let table = events_table(&test);
    let attempts = |id: Uuid| {
        let pool = test.pool.clone();
        let table = table.clone();
        async move {
            sqlx::query_scalar::<_, i32>(&format!("SELECT attempts FROM {table} WHERE id = $1"))
                .bind(id)
                .fetch_optional(&pool)
                .await
                .expect("attempts")
        }
    };

    let order = with_relay(&relay, async {
        // Outlast the retry schedule many times over.
        pgoutbox_core::testing::hold_outage(&health, Duration::from_secs(4), DEADLINE)
            .await
            .expect("an outage the relay sees");
        for id in &ids {
            assert_eq!(
                attempts(*id).await,
                Some(0),
                "the outage counted an attempt"
            );
        }
        assert!(
            relay.publisher().check().await.is_err(),
            "check must fail during the outage"
        );

        proxy.restore();
        let order = receive_all(&target, &ids).await.0;
        wait_until("an empty outbox", || async {
            relay.store().pending().await.expect("pending") == 0
        })
        .await;
        wait_until("the relay sees NATS up", || async { health.is_up() }).await;
        order
    })
    .await;

    // Every event once in the stream (sends the client buffered during the outage
    // and the relay's sends are deduplicated by event id), in per-aggregate order.
    assert_eq!(target.stored().await, ids.len() as u64);
    let runs: Vec<Vec<Uuid>> = (0..5).map(|a| vec![ids[a], ids[a + 5]]).collect();
    pgoutbox_core::testing::check_first_arrivals(&order, &runs).expect("per-aggregate order");
    let dead = DeadLetters::new(test.pool.clone(), &test.outbox);
    let dead_ids: Vec<Uuid> = dead
        .list(&DeadLetterFilter::default(), 10)
        .await
        .expect("dead letters")
        .iter()
        .map(|d| d.event.id)
        .collect();
    assert_eq!(
        dead_ids,
        vec![big.id],
        "only the oversized event is a dead letter"
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
