//! End to end: events enqueued in PostgreSQL transactions reach a real RabbitMQ queue.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use common::{amqp_addr, amqp_url, url_via, AmqpTarget};
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

/// Get until every id in `ids` was received; returns arrival order and counts.
async fn receive_all(target: &AmqpTarget, ids: &[Uuid]) -> (Vec<Uuid>, HashMap<Uuid, usize>) {
    let wanted: HashSet<Uuid> = ids.iter().copied().collect();
    let mut order = Vec::new();
    let mut counts: HashMap<Uuid, usize> = HashMap::new();
    let deadline = Instant::now() + DEADLINE;
    while !wanted.iter().all(|id| counts.contains_key(id)) {
        assert!(
            Instant::now() < deadline,
            "not all events arrived: {counts:?}"
        );
        for (meta, _) in target.get(100, Duration::from_millis(500)).await {
            order.push(meta.event_id);
            *counts.entry(meta.event_id).or_default() += 1;
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

/// A refused login is the broker's failure, not the messages': no attempt counts.
#[tokio::test]
async fn a_wrong_password_is_an_outage_not_a_message_failure() {
    let target = AmqpTarget::new().await;
    let url = url_via(amqp_addr()).replace("guest:guest@", "guest:wrong-password@");
    let publisher = target
        .config(&url)
        .build()
        .expect("built; it connects on use");
    let events = vec![pgoutbox_core::conformance::event(
        "order",
        "o-1",
        "order.created",
        1,
    )];
    let outcomes = publisher.publish(&events).await;
    let error = match &outcomes[..] {
        [pgoutbox_core::Outcome::Failed(error)] => error.clone(),
        other => panic!("expected one failure, got {other:?}"),
    };
    assert!(error.is_unavailable(), "{error:?}");
    let check = publisher.check().await.expect_err("check must fail");
    assert!(check.is_unavailable(), "{check:?}");
    target.delete().await;
}

#[tokio::test]
async fn unroutable_message_is_a_dead_letter_and_others_flow() {
    let test = TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL");
    let target = AmqpTarget::new().await;
    let publisher = target.config(&amqp_url()).connect().await.expect("connect");
    let relay = Relay::new(test.store(), publisher).with_config(broker_relay_config());

    let lost = NewEvent::new(
        "payment",
        "p-1",
        "payment.captured",
        &serde_json::json!({"amount": 5}),
    );
    let mut events = vec![lost.clone()];
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

    assert!(!counts.contains_key(&lost.id));
    let letter = dead
        .show(lost.id)
        .await
        .expect("show")
        .expect("dead letter of the unroutable event");
    let error = letter.last_error.unwrap_or_default();
    assert!(
        error.contains("permanent") && error.contains("unroutable"),
        "last error: {error}"
    );
    assert!(
        error.contains("payment.captured"),
        "the error names the routing key: {error}"
    );
    assert_eq!(
        letter.event.attempts, 1,
        "a permanent failure is not retried"
    );
    assert_eq!(relay.store().pending().await.expect("pending"), 0);
    target.delete().await;
    test.drop_schema().await.expect("drop schema");
}
