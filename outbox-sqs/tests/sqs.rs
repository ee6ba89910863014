//! SQS-specific behaviour against moto, and end to end through PostgreSQL.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{new_queue, read, unique};
use pgoutbox_core::conformance::claimed_event;
use pgoutbox_core::testing::{event_ids, interleaved_events};
use pgoutbox_core::{Event, FailureKind, NewEvent, Outcome, Publisher, Relay, Store};
use pgoutbox_postgres::testing::{broker_relay_config, TestOutbox};
use pgoutbox_postgres::{DeadLetterFilter, DeadLetters};
use pgoutbox_sqs::aws_sdk_sqs::types::Message;
use pgoutbox_sqs::aws_sdk_sqs::types::MessageSystemAttributeName;
use uuid::Uuid;

fn ids(messages: &[Message]) -> Vec<Uuid> {
    event_ids(messages, pgoutbox_sqs::event_id)
}

#[tokio::test(flavor = "multi_thread")]
async fn fifo_sets_group_and_dedup_and_drops_a_resend() {
    let (publisher, url) = new_queue("fifo", true).await;
    let e = claimed_event("order", "order-42", "order.created", 1);
    assert_eq!(
        publisher.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Published]
    );
    // The relay crashed before recording: the same event id is sent again.
    assert_eq!(
        publisher.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Published]
    );

    let messages = read(publisher.client(), &url, 10, Duration::from_secs(5)).await;
    // Keep reading a little: a duplicate would show up now.
    let more = read(publisher.client(), &url, 10, Duration::from_secs(2)).await;
    assert_eq!(
        ids(&messages).len() + ids(&more).len(),
        1,
        "the re-send was delivered twice"
    );
    let system = messages[0].attributes().cloned().unwrap_or_default();
    assert_eq!(
        system
            .get(&MessageSystemAttributeName::MessageGroupId)
            .map(String::as_str),
        Some("order-42")
    );
    let dedup = e.id.to_string();
    assert_eq!(
        system
            .get(&MessageSystemAttributeName::MessageDeduplicationId)
            .map(String::as_str),
        Some(dedup.as_str())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn many_events_go_out_in_batches_of_ten() {
    let (_, url) = new_queue("standard", false).await;
    // By URL this time; 25 events: 3 calls.
    let publisher = common::config(&url).build().await.unwrap();
    let events: Vec<Event> = (0..25)
        .map(|i| claimed_event("order", &format!("o-{}", i % 7), "order.created", i))
        .collect();
    assert_eq!(
        publisher.publish(&events).await,
        vec![Outcome::Published; 25]
    );
    let got: HashSet<Uuid> =
        ids(&read(publisher.client(), &url, 25, Duration::from_secs(20)).await)
            .into_iter()
            .collect();
    assert_eq!(got, events.iter().map(|e| e.id).collect::<HashSet<_>>());
}

#[tokio::test(flavor = "multi_thread")]
async fn many_headers_are_packed_and_read_back() {
    let (publisher, url) = new_queue("headers", false).await;
    let mut e = claimed_event("order", "1", "order.created", 1);
    e.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    for i in 0..9 {
        e.headers.insert(format!("h{i}"), format!("value {i}"));
    }
    assert_eq!(
        publisher.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Published]
    );
    let messages = read(publisher.client(), &url, 1, Duration::from_secs(10)).await;
    assert_eq!(messages.len(), 1);
    let attributes = messages[0]
        .message_attributes()
        .map(|a| a.len())
        .unwrap_or(0);
    assert!(attributes <= 10, "{attributes} attributes");
    let r = pgoutbox_sqs::metadata(&messages[0]).unwrap();
    assert_eq!(r.headers, e.headers);
    assert_eq!(r.traceparent(), e.traceparent());
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_and_invalid_queues_fail_permanently() {
    let (publisher, _) = new_queue("good", false).await;
    let mut missing_name = claimed_event("order", "1", "order.created", 1);
    missing_name.destination = Some(unique("missing", false));
    let mut missing_url = claimed_event("order", "2", "order.created", 2);
    missing_url.destination = Some(format!(
        "{}/123456789012/{}",
        common::endpoint(),
        unique("nope", false)
    ));
    let mut invalid = claimed_event("order", "3", "order.created", 3);
    invalid.destination = Some("not a queue!".into());
    let good = claimed_event("order", "4", "order.created", 4);
    let outcomes = publisher
        .publish(&[missing_name, missing_url, invalid, good])
        .await;
    for (i, o) in outcomes.iter().take(3).enumerate() {
        assert!(
            matches!(o, Outcome::Failed(e) if e.kind == FailureKind::Permanent),
            "event {i}: {o:?}"
        );
    }
    assert_eq!(outcomes[3], Outcome::Published);
    publisher.check().await.unwrap();
}

/// Run the relay until the outbox is empty, at most `limit`.
async fn drain<S: Store, P: Publisher>(relay: &Relay<S, P>, limit: Duration) {
    pgoutbox_core::testing::drain(relay, limit)
        .await
        .expect("relay drains the outbox");
}

async fn db() -> TestOutbox {
    TestOutbox::new()
        .await
        .expect("PostgreSQL (DATABASE_URL) for the end-to-end test")
}

#[tokio::test(flavor = "multi_thread")]
async fn end_to_end_fifo_keeps_group_order() {
    let db = db().await;
    let (publisher, url) = new_queue("orders", true).await;
    let mut sent = Vec::new();
    // Four rounds of three aggregates, one transaction per round.
    for round in interleaved_events("order-", 3, 4).chunks(3) {
        sent.extend(db.enqueue_committed(round).await.unwrap());
    }
    let client = publisher.client().clone();
    let relay = Relay::new(db.store(), publisher).with_config(broker_relay_config());
    drain(&relay, Duration::from_secs(60)).await;
    let messages = read(&client, &url, sent.len(), Duration::from_secs(20)).await;
    assert_eq!(
        ids(&messages).into_iter().collect::<HashSet<_>>(),
        sent.iter().copied().collect::<HashSet<_>>()
    );
    for a in 0..3 {
        let rounds: Vec<i64> = messages
            .iter()
            .filter(|m| pgoutbox_sqs::metadata(m).unwrap().aggregate_id == format!("order-{a}"))
            .map(|m| {
                serde_json::from_str::<serde_json::Value>(m.body().unwrap()).unwrap()["n"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert_eq!(rounds, vec![0, 1, 2, 3], "group order-{a}");
    }
    db.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn oversize_entry_dead_letters_alone() {
    let db = db().await;
    let (publisher, url) = new_queue("partial", false).await;
    // One transaction: six events, then one too large for SQS.
    let mut events: Vec<NewEvent> = (0..6)
        .map(|i| {
            NewEvent::new(
                "order",
                format!("o-{i}"),
                "order.created",
                &serde_json::json!({"i": i}),
            )
        })
        .collect();
    events.push(NewEvent::new(
        "order",
        "o-big",
        "order.created",
        &serde_json::json!({"big": "x".repeat(300 * 1024)}),
    ));
    let mut good = db.enqueue_committed(&events).await.unwrap();
    let big_id = good.pop().unwrap();

    let client = publisher.client().clone();
    let relay = Relay::new(db.store(), publisher).with_config(broker_relay_config());
    drain(&relay, Duration::from_secs(60)).await;
    let dead = DeadLetters::new(db.pool.clone(), &db.outbox);
    assert_eq!(dead.count(&DeadLetterFilter::default()).await.unwrap(), 1);
    let letter = dead
        .show(big_id)
        .await
        .unwrap()
        .expect("the oversize event is a dead letter");
    assert!(
        letter.last_error.unwrap_or_default().contains("exceeds"),
        "error names the size"
    );
    let got: HashSet<Uuid> = ids(&read(&client, &url, good.len(), Duration::from_secs(20)).await)
        .into_iter()
        .collect();
    assert_eq!(got, good.into_iter().collect::<HashSet<_>>());
    db.drop_schema().await.unwrap();
}
