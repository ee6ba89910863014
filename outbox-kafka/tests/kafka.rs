//! Kafka-specific behaviour against librdkafka's mock cluster, and end to end
//! through PostgreSQL.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use common::{
    consumer, create_topic, group_consumer, key, read, tansu_bootstrap, unique, MockKafka,
};
use pgoutbox_core::conformance::claimed_event;
use pgoutbox_core::testing::{event_ids, interleaved_events};
use pgoutbox_core::{Event, FailureKind, NewEvent, Outcome, Publisher, Relay, Store};
use pgoutbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use pgoutbox_kafka::rdkafka::message::Message;
use pgoutbox_kafka::rdkafka::ClientConfig;
use pgoutbox_kafka::KafkaConfig;
use pgoutbox_postgres::testing::{broker_relay_config, TestOutbox};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread")]
async fn events_of_one_aggregate_share_a_partition_in_order() {
    let (mock, topic) = MockKafka::with_topic(3, "order", 6);
    let publisher = KafkaConfig::new(mock.bootstrap())
        .topic(&topic)
        .build()
        .unwrap();
    let events: Vec<Event> = (0..60)
        .map(|i| claimed_event("order", &format!("agg-{}", i % 5), "order.changed", i))
        .collect();
    let outcomes = publisher.publish(&events).await;
    assert_eq!(outcomes, vec![Outcome::Published; events.len()]);

    let messages = read(
        &consumer(mock.bootstrap(), &topic, 6),
        events.len(),
        Duration::from_secs(30),
    )
    .await;
    let got: HashSet<Uuid> = event_ids(&messages, pgoutbox_kafka::event_id)
        .into_iter()
        .collect();
    let sent: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    assert_eq!(got, sent, "every event id is read back");

    let mut partitions: BTreeMap<String, HashSet<i32>> = BTreeMap::new();
    for m in &messages {
        partitions.entry(key(m)).or_default().insert(m.partition());
    }
    for (aggregate, parts) in &partitions {
        assert_eq!(
            parts.len(),
            1,
            "aggregate {aggregate} spread over partitions {parts:?}"
        );
    }
    for aggregate in partitions.keys() {
        let mut mine: Vec<_> = messages.iter().filter(|m| &key(m) == aggregate).collect();
        mine.sort_by_key(|m| m.offset());
        let got: Vec<Uuid> = mine
            .iter()
            .map(|m| pgoutbox_kafka::event_id(*m).unwrap())
            .collect();
        let sent: Vec<Uuid> = events
            .iter()
            .filter(|e| &e.aggregate_id == aggregate)
            .map(|e| e.id)
            .collect();
        assert_eq!(got, sent, "offset order of aggregate {aggregate}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn headers_carry_the_envelope() {
    let (mock, topic) = MockKafka::with_topic(1, "envelope", 1);
    let publisher = KafkaConfig::new(mock.bootstrap())
        .route_aggregate_type("invoice", &topic)
        .build()
        .unwrap();
    let mut e = claimed_event("invoice", "inv-7", "invoice.paid", 1);
    e.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    e.headers.insert("tenant".into(), "acme".into());
    e.headers
        .insert(pgoutbox_kafka::headers::EVENT_ID.into(), "spoofed".into());
    assert_eq!(
        publisher.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Published]
    );

    let messages = read(
        &consumer(mock.bootstrap(), &topic, 1),
        1,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(messages.len(), 1);
    let m = &messages[0];
    assert_eq!(m.key(), Some(&b"inv-7"[..]));
    assert_eq!(m.payload(), Some(e.payload_str().as_bytes()));
    let r = pgoutbox_kafka::metadata(m).unwrap();
    assert_eq!(
        r.event_id, e.id,
        "reserved header names cannot be overridden"
    );
    assert_eq!(r.event_type, "invoice.paid");
    assert_eq!(r.aggregate_type, "invoice");
    assert_eq!(r.aggregate_id, "inv-7");
    assert!(
        (r.created_at.expect("created_at") - e.created_at)
            .num_milliseconds()
            .abs()
            < 1
    );
    assert_eq!(r.traceparent(), e.traceparent());
    assert_eq!(r.headers.get("tenant").map(String::as_str), Some("acme"));
    assert!(!r.headers.contains_key(pgoutbox_kafka::headers::EVENT_ID));
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_and_invalid_topics_fail_permanently() {
    let (mock, known) = MockKafka::with_topic(1, "known", 1);
    let publisher = KafkaConfig::new(mock.bootstrap())
        .topic(&known)
        // A cluster that does not create topics on first use; give up on a missing one fast.
        .set("allow.auto.create.topics", "false")
        .set("topic.metadata.propagation.max.ms", "1000")
        .build()
        .unwrap();
    let mut unknown = claimed_event("order", "1", "order.created", 1);
    unknown.destination = Some(unique("missing"));
    let mut invalid = claimed_event("order", "2", "order.created", 2);
    invalid.destination = Some("not a topic!".into());
    let good = claimed_event("order", "3", "order.created", 3);
    let started = Instant::now();
    let outcomes = publisher.publish(&[unknown, invalid, good]).await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        matches!(&outcomes[0], Outcome::Failed(e) if e.kind == FailureKind::Permanent),
        "{outcomes:?}"
    );
    assert!(
        matches!(&outcomes[1], Outcome::Failed(e) if e.kind == FailureKind::Permanent),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[2], Outcome::Published);
}

#[tokio::test(flavor = "multi_thread")]
async fn check_sees_the_cluster() {
    let mock = MockKafka::start(1);
    let publisher = KafkaConfig::new(mock.bootstrap()).build().unwrap();
    publisher.check().await.unwrap();
}

/// Run the relay until the outbox is empty, at most `limit`.
async fn drain<S: Store, P: Publisher>(relay: &Relay<S, P>, limit: Duration) {
    pgoutbox_core::testing::drain(relay, limit)
        .await
        .expect("relay drains the outbox");
}

/// `per_aggregate` rounds of one event on each of `aggregates` aggregates
/// `order-<a>`, a transaction per round, each event with a `traceparent`.
async fn enqueue_orders(db: &TestOutbox, aggregates: usize, per_aggregate: usize) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for round in interleaved_events("order-", aggregates, per_aggregate).chunks(aggregates) {
        let round: Vec<NewEvent> = round
            .iter()
            .map(|e| {
                e.clone()
                    .with_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            })
            .collect();
        ids.extend(db.enqueue_committed(&round).await.expect("enqueue"));
    }
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn end_to_end_through_postgres() {
    let (mock, topic) = MockKafka::with_topic(1, "orders", 4);
    let reader = consumer(mock.bootstrap(), &topic, 4);
    end_to_end(mock.bootstrap(), &topic, &reader).await;
}

/// The same against tansu, a Kafka-protocol broker process, read back by a consumer
/// that joins a consumer group (subscribe, not assign).
#[tokio::test(flavor = "multi_thread")]
async fn end_to_end_through_postgres_on_tansu() {
    let bootstrap = tansu_bootstrap();
    let topic = unique("orders");
    create_topic(&bootstrap, &topic, 4).await;
    let reader = group_consumer(&bootstrap, &topic);
    end_to_end(&bootstrap, &topic, &reader).await;
}

/// 4 aggregates x 5 events through PostgreSQL and the relay to `topic` (4
/// partitions): every event arrives, each aggregate's in insertion order.
async fn end_to_end(bootstrap: &str, topic: &str, reader: &StreamConsumer) {
    let db = TestOutbox::new()
        .await
        .expect("PostgreSQL (DATABASE_URL) for the end-to-end test");
    let ids = enqueue_orders(&db, 4, 5).await;
    let publisher = KafkaConfig::new(bootstrap)
        .topic(topic)
        .build()
        .expect("publisher");
    let relay = Relay::new(db.store(), publisher).with_config(broker_relay_config());
    drain(&relay, Duration::from_secs(60)).await;

    let messages = read(reader, ids.len(), Duration::from_secs(30)).await;
    let got = event_ids(&messages, pgoutbox_kafka::event_id);
    assert_eq!(
        got.iter().collect::<HashSet<_>>(),
        ids.iter().collect::<HashSet<_>>()
    );
    // Per aggregate, offsets follow insertion order.
    for a in 0..4 {
        let aggregate = format!("order-{a}");
        let mut mine: Vec<_> = messages.iter().filter(|m| key(m) == aggregate).collect();
        mine.sort_by_key(|m| m.offset());
        let rounds: Vec<i64> = mine
            .iter()
            .map(|m| {
                let v: serde_json::Value =
                    serde_json::from_slice(m.payload().expect("a payload")).expect("JSON");
                v["n"].as_i64().expect("the event's round")
            })
            .collect();
        assert_eq!(rounds, (0..5).collect::<Vec<_>>(), "order of {aggregate}");
    }
    db.drop_schema().await.expect("drop schema");
}

/// `ensure_topic` creates a topic with its partitions and `delete_topic` removes
/// it, on tansu (a broker process, as a real cluster); deleting a topic that is
/// not there is not an error.
#[tokio::test(flavor = "multi_thread")]
async fn a_topic_made_by_ensure_topic_goes_with_delete_topic_on_tansu() {
    let bootstrap = tansu_bootstrap();
    let topic = unique("bench");
    let config = KafkaConfig::new(&bootstrap).topic(&topic);
    let metadata: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .expect("metadata client");
    config
        .ensure_topic(&topic, 3, Duration::from_secs(30))
        .await
        .expect("ensure_topic");
    assert_eq!(listed_partitions(&metadata, &topic), Some(3));

    config
        .delete_topic(&topic, Duration::from_secs(30))
        .await
        .expect("delete_topic");
    // The metadata the broker serves may lag its answer to the deletion.
    let deadline = Instant::now() + Duration::from_secs(20);
    while listed_partitions(&metadata, &topic).is_some() {
        assert!(
            Instant::now() < deadline,
            "topic {topic} still listed 20 s after delete_topic"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    config
        .delete_topic(&topic, Duration::from_secs(30))
        .await
        .expect("deleting a topic that is gone");
}

/// The partition count of `topic` in the cluster's list of every topic (asking for
/// all topics, not this one, so that no broker creates it on the way).
fn listed_partitions(client: &BaseConsumer, topic: &str) -> Option<usize> {
    let metadata = client
        .fetch_metadata(None, Duration::from_secs(10))
        .expect("metadata of every topic");
    metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len())
}
