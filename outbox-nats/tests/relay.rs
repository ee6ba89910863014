//! The relay and JetStream's deduplication: a republished event is stored once.

mod common;

use std::time::Duration;

use common::NatsTarget;
use pgoutbox_core::{NewEvent, Relay};
use pgoutbox_postgres::testing::{broker_relay_config, TestOutbox};

/// How long to read back the one message.
const READ_WAIT: Duration = Duration::from_secs(10);

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
    test.enqueue_committed(std::slice::from_ref(&event))
        .await
        .expect("enqueue");
    let first = relay.run_once().await.expect("relay");
    assert_eq!(first.published, 1);
    assert_eq!(relay.publisher().duplicates(), 0);

    // A relay that crashed after publishing but before recording publishes it again:
    // the same event (same id) is due once more.
    test.enqueue_committed(std::slice::from_ref(&event))
        .await
        .expect("enqueue");
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

    let got = target.fetch(10, READ_WAIT).await;
    assert_eq!(
        got.iter().map(|m| m.id()).collect::<Vec<_>>(),
        vec![event.id],
        "the consumer gets the event once"
    );
    let more = target.fetch(10, Duration::from_millis(300)).await;
    assert!(
        more.is_empty(),
        "consumer got more: {:?}",
        more.iter().map(|m| m.id()).collect::<Vec<_>>()
    );
    target.delete().await;
    test.drop_schema().await.expect("drop schema");
}
