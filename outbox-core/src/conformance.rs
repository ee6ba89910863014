//! Publisher conformance suite: one set of checks every [`Publisher`] runs against its
//! **real** broker (in the spirit of object_store's `integration.rs`).
//!
//! A broker crate implements [`ConformanceTarget`] in its tests (build a publisher,
//! read messages back, make an event the broker refuses, build a publisher for an
//! unreachable broker) and runs every check with
//! [`conformance_tests!`](crate::conformance_tests) (one `#[tokio::test]` each), or
//! calls the suite's async functions itself. Every check panics with a clear message
//! when the contract is broken, and finishes in bounded time.
//!
//! Not a stable API: checks are added and tightened as the publisher contract grows.
//!
//! ```no_run
//! use std::time::Duration;
//! use pgoutbox_core::conformance::{BoxError, ConformanceTarget, ReceivedMessage};
//! use pgoutbox_core::{Event, NullPublisher};
//!
//! struct MyBroker; // e.g. holds a unique stream/queue name per test
//!
//! impl ConformanceTarget for MyBroker {
//!     type Publisher = NullPublisher;
//!     async fn publisher(&self) -> Result<NullPublisher, BoxError> { Ok(NullPublisher) }
//!     async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
//!         Ok(Vec::new()) // read up to `max` messages, waiting at most `wait`
//!     }
//!     fn refused(&self, event: Event) -> Event { event } // e.g. make it too large
//!     async fn unreachable_publisher(&self) -> Result<NullPublisher, BoxError> { Ok(NullPublisher) }
//! }
//!
//! // Every check, one test each (or call e.g. `conformance::publish_and_read_back`).
//! pgoutbox_core::conformance_tests!(MyBroker);
//! ```
//!
//! Rules the suite relies on:
//! - it only creates events with [`claimed_event`]: aggregate types start with `conformance_`,
//!   event types with `conformance.` (valid in NATS subjects, AMQP routing keys, Kafka
//!   topic and SQS names once the adapter maps them), `destination` is `None` except in
//!   what [`ConformanceTarget::refused`] returns;
//! - [`ConformanceTarget::receive`] may return messages of earlier checks or duplicates:
//!   the suite keeps the first copy of the ids it published and ignores the rest;
//! - all messages of one aggregate are read back in broker order.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use uuid::Uuid;

use serde::{Deserialize, Serialize};

use crate::envelope::{CloudEvents, ContentMode, Envelope, Metadata};
use crate::event::{Event, Headers, NewEvent, TypedEvent, TRACEPARENT};
use crate::publisher::{FailureKind, Outcome, Publisher, RunOrder, RunOutcome};

pub mod memory;
pub mod proxy;

/// Error type of the target's methods: anything, shown in the panic message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Longest time the suite waits to read back what it published.
pub const RECEIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest time a publish or check against an unreachable broker may take
/// (configure the unreachable publisher's timeout well below it, a few seconds).
pub const UNREACHABLE_DEADLINE: Duration = Duration::from_secs(30);

/// Longest time any publish to the reachable broker may take in the suite.
pub const PUBLISH_DEADLINE: Duration = Duration::from_secs(60);

/// How long the suite keeps reading to make sure a message held back or refused
/// does not arrive late.
pub const NOT_RECEIVED_WAIT: Duration = Duration::from_secs(2);

/// A message read back from the broker, in broker-neutral form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedMessage {
    /// The event id, read from the message's dedup key (`Nats-Msg-Id`, AMQP
    /// `message_id`, SQS `MessageDeduplicationId` or attribute, Kafka header).
    pub id: Uuid,
    /// The event type.
    pub event_type: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// When the event was written, if the message carries it (the suite requires it).
    pub created_at: Option<DateTime<Utc>>,
    /// The message body: the event's JSON payload, byte for byte.
    pub payload: Vec<u8>,
    /// The message headers/attributes. Must contain every user header of the event
    /// (including [`TRACEPARENT`]); extra metadata headers are allowed.
    pub headers: Headers,
}

impl ReceivedMessage {
    /// A message read back through the adapter's consumer helper: its [`Metadata`]
    /// and body (whose payload [`Metadata::payload`] takes out, whatever the
    /// envelope).
    pub fn new(metadata: Metadata, body: &[u8]) -> Result<Self, crate::DecodeError> {
        let payload = metadata.payload(body)?.to_vec();
        Ok(Self {
            id: metadata.event_id,
            event_type: metadata.event_type,
            aggregate_type: metadata.aggregate_type,
            aggregate_id: metadata.aggregate_id,
            created_at: metadata.created_at,
            payload,
            headers: metadata.headers,
        })
    }
}

/// The CloudEvents envelope in binary mode, as the suite runs it
/// ([`conformance_tests!`](crate::conformance_tests)`(@envelopes ...)`).
pub fn cloudevents_binary() -> Envelope {
    cloudevents(ContentMode::Binary)
}

/// The CloudEvents envelope in structured mode, as the suite runs it.
pub fn cloudevents_structured() -> Envelope {
    cloudevents(ContentMode::Structured)
}

fn cloudevents(mode: ContentMode) -> Envelope {
    let config = CloudEvents::new(mode, "/pgoutbox/conformance")
        .and_then(|c| c.subject("{aggregate_type}/{aggregate_id}"))
        .unwrap_or_else(|e| unreachable!("valid CloudEvents settings: {e}"));
    Envelope::CloudEvents(config)
}

/// What a broker crate provides to run the suite against its real broker.
///
/// Use a fresh destination (stream, queue, topic) per target so tests can run in parallel.
pub trait ConformanceTarget: Send + Sync {
    /// The publisher under test.
    type Publisher: Publisher;

    /// A publisher connected to the broker, routing every event made by [`claimed_event`]
    /// to where [`ConformanceTarget::receive`] reads.
    fn publisher(&self) -> impl Future<Output = Result<Self::Publisher, BoxError>> + Send;

    /// Read up to `max` messages published so far, waiting at most `wait` for the
    /// first ones; an empty vector when none came. Messages must be acknowledged/removed
    /// so they are not returned again (a redelivered duplicate is tolerated).
    fn receive(
        &self,
        max: usize,
        wait: Duration,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, BoxError>> + Send;

    /// Turn a valid event into one the broker refuses for good: a payload over the
    /// broker's size limit, a destination nothing is bound to (AMQP `mandatory`), ...
    fn refused(&self, event: Event) -> Event;

    /// A publisher pointed at an unreachable broker (a closed port on 127.0.0.1)
    /// with a short timeout (a few seconds). Building it must succeed: a relay must
    /// be able to start while its broker is down.
    fn unreachable_publisher(
        &self,
    ) -> impl Future<Output = Result<Self::Publisher, BoxError>> + Send;
}

/// A [`ConformanceTarget`] whose broker a check can take away and bring back: for
/// the outage checks (`pgoutbox_postgres::conformance::relay_outage_loses_nothing`).
/// A target usually keeps a [`proxy::TcpProxy`] in front of its broker.
pub trait OutageTarget: ConformanceTarget {
    /// A publisher, routing like [`ConformanceTarget::publisher`], whose broker
    /// [`OutageTarget::cut`] makes unreachable, with a short timeout (a few seconds).
    /// Built while the broker is reachable.
    fn outage_publisher(&self) -> impl Future<Output = Result<Self::Publisher, BoxError>> + Send;

    /// Make the broker unreachable for publishers from [`OutageTarget::outage_publisher`]
    /// (open connections drop, new ones fail); reading back still works.
    fn cut(&self);

    /// Make the broker reachable again.
    fn restore(&self);
}

/// A test event as the relay would claim it: fresh id, `created_at` now, no attempts,
/// the given headers, a small JSON payload naming the aggregate and a sequence number.
pub fn claimed_event(
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    seq: i64,
) -> Event {
    let payload = serde_json::json!({
        "aggregate": aggregate_id,
        "seq": seq,
        "text": "conformance \u{e9}\u{2713}",
    });
    Event {
        id: Uuid::now_v7(),
        seq,
        aggregate_type: aggregate_type.to_string(),
        aggregate_id: aggregate_id.to_string(),
        event_type: event_type.to_string(),
        payload: raw_json(&payload),
        headers: Headers::new(),
        destination: None,
        created_at: Utc::now(),
        attempts: 0,
    }
}

/// A JSON value as a boxed raw value (for building [`Event`]s in tests).
pub fn raw_json(value: &serde_json::Value) -> Box<RawValue> {
    // Serialising a `Value` always yields valid JSON text.
    RawValue::from_string(value.to_string())
        .unwrap_or_else(|_| unreachable!("serde_json::Value serialises to valid JSON"))
}

const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn traced(mut e: Event, n: usize) -> Event {
    e.headers.insert(TRACEPARENT.into(), TRACE.into());
    e.headers
        .insert("tenant".into(), format!("tenant-{}", n % 3));
    e
}

/// One `#[tokio::test]` per check of the suite, each on a fresh target: the one
/// list of checks, for every broker crate's conformance test file.
///
/// `conformance_tests!(make)` where `make` is an expression (it may `.await`) giving
/// a [`ConformanceTarget`]; `conformance_tests!(make, cleanup)` also calls
/// `cleanup(target)` (a closure returning a future) after each check that passed.
/// The crate using it needs `tokio` with the `macros` and `rt-multi-thread` features.
///
/// `conformance_tests!(@envelopes |envelope| MyBroker::with(envelope), cleanup)` runs
/// the checks that read what the envelope writes once per CloudEvents content mode
/// ([`cloudevents_binary`], [`cloudevents_structured`]), in modules of those names:
/// `make` is a closure from an [`Envelope`] to a future of a target whose
/// publisher encodes with it, and whose `receive` reads through the adapter's
/// consumer helper ([`ReceivedMessage::new`]).
///
/// (The module documentation has a complete example.)
///
/// ```text
/// pgoutbox_core::conformance_tests!(MyBroker::new().await, |b: MyBroker| async move {
///     b.delete().await
/// });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!($make, |_| async {});
    };
    ($make:expr, $cleanup:expr) => {
        $crate::conformance_tests!(@checks $make, $cleanup;
            empty_batch,
            publish_and_read_back,
            message_envelope,
            per_aggregate_order,
            republish_is_published,
            refused_message_fails_alone,
            failed_event_holds_back_its_run,
            hot_run_failure_keeps_order,
            typed_payload_round_trip,
            unreachable_broker_is_unavailable,
        );
    };
    // The checks that read what the envelope writes, once per CloudEvents content
    // mode: `$make` is a closure from an `Envelope` to a future of a target whose
    // publisher uses it.
    (@envelopes $make:expr, $cleanup:expr) => {
        mod cloudevents_binary {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_tests!(@checks ($make)($crate::conformance::cloudevents_binary()).await, $cleanup;
                publish_and_read_back, message_envelope, typed_payload_round_trip);
        }
        mod cloudevents_structured {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_tests!(@checks ($make)($crate::conformance::cloudevents_structured()).await, $cleanup;
                publish_and_read_back, message_envelope, typed_payload_round_trip);
        }
    };
    (@checks $make:expr, $cleanup:expr; $($check:ident),* $(,)?) => {
        $crate::conformance_tests!(@checks_of $crate; $make, $cleanup; $($check),*);
    };
    // One test per check function `$krate::conformance::<check>` (also used by
    // `pgoutbox_postgres::relay_conformance_tests!` for its own checks).
    (@checks_of $krate:tt; $make:expr, $cleanup:expr; $($check:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $check() {
            let target = $make;
            $krate::conformance::$check(&target).await;
            let cleanup = $cleanup;
            cleanup(target).await;
        }
    )*};
}

/// A payload written from a typed value ([`NewEvent::typed`]) is read back on the
/// consumer side ([`crate::envelope::decode`]) as the same value, non-ASCII text,
/// escapes and `null` included; decoding it as another type names the event.
pub async fn typed_payload_round_trip<T: ConformanceTarget>(target: &T) {
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "kind")]
    enum AccountEvent {
        Opened {
            owner: String,
            limit_cents: i64,
            tags: Vec<String>,
        },
        Closed {
            reason: Option<String>,
        },
    }
    impl TypedEvent for AccountEvent {
        fn event_type(&self) -> &str {
            match self {
                AccountEvent::Opened { .. } => "conformance.account.opened",
                AccountEvent::Closed { .. } => "conformance.account.closed",
            }
        }
    }
    #[derive(Debug, Deserialize)]
    struct NotAnAccountEvent {
        #[allow(dead_code)]
        amount: u64,
    }

    let values = [
        AccountEvent::Opened {
            owner: "Zo\u{eb} \u{2713} \u{1f600}".into(),
            limit_cents: -5_000,
            tags: vec!["a\"b".into(), "line\nbreak".into()],
        },
        AccountEvent::Closed { reason: None },
        AccountEvent::Closed {
            reason: Some("tab\there".into()),
        },
    ];
    let events: Vec<Event> = values
        .iter()
        .enumerate()
        .map(|(i, value)| {
            let new = NewEvent::typed("conformance_account", "a-1", value)
                .unwrap_or_else(|e| panic!("cannot serialise a test value: {e}"));
            let mut e = claimed_event("conformance_account", "a-1", &new.event_type, i as i64);
            e.id = new.id;
            e.payload = RawValue::from_string(new.payload)
                .unwrap_or_else(|e| panic!("serde_json wrote invalid JSON: {e}"));
            e
        })
        .collect();
    let publisher = build(target.publisher(), "publisher").await;
    let outcomes = publish(&publisher, &events).await;
    assert_all_published(&events, &outcomes);
    let received = collect(target, &ids(&events), &HashSet::new()).await;
    for (value, got) in values.iter().zip(&received) {
        let decoded: AccountEvent = crate::envelope::decode(got.id, &got.event_type, &got.payload)
            .unwrap_or_else(|e| panic!("typed payload does not read back: {e}"));
        assert_eq!(
            &decoded, value,
            "message {} decodes to another value",
            got.id
        );
    }
    let first = &received[0];
    let err =
        crate::envelope::decode::<NotAnAccountEvent>(first.id, &first.event_type, &first.payload)
            .expect_err("an account event is not a NotAnAccountEvent");
    assert!(
        err.to_string().contains(&first.id.to_string()),
        "decode error does not name the event: {err}"
    );
}

/// An empty batch publishes nothing and returns no outcome.
pub async fn empty_batch<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.publisher(), "publisher").await;
    let outcomes = publish(&publisher, &[]).await;
    assert!(
        outcomes.is_empty(),
        "empty batch gave outcomes: {outcomes:?}"
    );
}

/// A batch over several aggregates is published (one `Published` per event, in order)
/// and every message is read back from the broker.
pub async fn publish_and_read_back<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.publisher(), "publisher").await;
    let events: Vec<Event> = (0..24)
        .map(|i| {
            let e = claimed_event(
                "conformance_order",
                &format!("o-{}", i % 4),
                "conformance.created",
                i,
            );
            traced(e, i as usize)
        })
        .collect();
    let outcomes = publish(&publisher, &events).await;
    assert_all_published(&events, &outcomes);
    // `collect` returns the message of each id; each must carry its own event.
    let received = collect(target, &ids(&events), &HashSet::new()).await;
    for (sent, got) in events.iter().zip(&received) {
        assert_eq!(
            (got.aggregate_id.as_str(), got.payload.as_slice()),
            (sent.aggregate_id.as_str(), sent.payload_str().as_bytes()),
            "message {} carries another event's aggregate or body",
            sent.id
        );
    }
}

/// Every message carries the event id as dedup key, event type, aggregate type and id,
/// `created_at`, the payload byte for byte and the user headers including `traceparent`.
pub async fn message_envelope<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.publisher(), "publisher").await;
    let mut a = claimed_event(
        "conformance_customer",
        "c-1",
        "conformance.customer.renamed",
        1,
    );
    a.headers.insert(TRACEPARENT.into(), TRACE.into());
    a.headers.insert("tenant".into(), "acme".into());
    a.headers
        .insert("x-request-id".into(), "req 42 / \u{e9}".into());
    a.payload = raw_json(&serde_json::json!({
        "name": "Zo\u{eb} \"quoted\" \u{1f600}",
        "nested": {"list": [1, 2.5, null, true], "empty": {}},
    }));
    // Same aggregate id under another aggregate type: both fields must travel.
    let mut b = claimed_event("conformance_invoice", "c-1", "conformance.invoice.paid", 2);
    b.headers
        .insert(TRACEPARENT.into(), TRACE.replace("01", "00"));
    // A payload that is not an object, and no user header but traceparent.
    let mut c = claimed_event(
        "conformance_invoice",
        "i/2 with space",
        "conformance.invoice.voided",
        3,
    );
    c.payload = raw_json(&serde_json::json!([1, "two", 3]));
    c.headers.insert(TRACEPARENT.into(), TRACE.into());
    let events = vec![a, b, c];
    let outcomes = publish(&publisher, &events).await;
    assert_all_published(&events, &outcomes);

    let received = collect(target, &ids(&events), &HashSet::new()).await;
    for (sent, got) in events.iter().zip(&received) {
        assert_eq!(got.id, sent.id, "dedup key (event id)");
        assert_eq!(got.event_type, sent.event_type, "event type of {}", sent.id);
        assert_eq!(
            got.aggregate_type, sent.aggregate_type,
            "aggregate type of {}",
            sent.id
        );
        assert_eq!(
            got.aggregate_id, sent.aggregate_id,
            "aggregate id of {}",
            sent.id
        );
        assert_eq!(
            String::from_utf8_lossy(&got.payload),
            sent.payload_str(),
            "payload of {} must arrive byte for byte",
            sent.id
        );
        let created_at = got
            .created_at
            .unwrap_or_else(|| panic!("message of {} carries no created_at", sent.id));
        let skew = (created_at - sent.created_at)
            .num_microseconds()
            .unwrap_or(i64::MAX)
            .abs();
        assert!(
            skew < 1000,
            "created_at of {}: sent {}, received {created_at}",
            sent.id,
            sent.created_at
        );
        for (name, value) in &sent.headers {
            assert_eq!(
                got.headers.get(name),
                Some(value),
                "header `{name}` of {} (received headers: {:?})",
                sent.id,
                got.headers
            );
        }
    }
}

/// Events of one aggregate arrive in batch order, with several aggregates interleaved.
pub async fn per_aggregate_order<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.publisher(), "publisher").await;
    let aggregates = ["a", "b", "c"];
    let events: Vec<Event> = (0..60)
        .map(|i| {
            let agg = aggregates[i % aggregates.len()];
            claimed_event(
                "conformance_account",
                agg,
                "conformance.account.changed",
                i as i64,
            )
        })
        .collect();
    let outcomes = publish(&publisher, &events).await;
    assert_all_published(&events, &outcomes);

    let received = collect_in_arrival_order(target, &ids(&events), &HashSet::new()).await;
    for agg in aggregates {
        let sent: Vec<Uuid> = events
            .iter()
            .filter(|e| e.aggregate_id == agg)
            .map(|e| e.id)
            .collect();
        let got: Vec<Uuid> = received
            .iter()
            .filter(|m| m.aggregate_id == agg)
            .map(|m| m.id)
            .collect();
        assert_eq!(
            got, sent,
            "order of aggregate {agg} (ids as sent vs as received)"
        );
    }
}

/// Publishing an event that was already published (the relay crashed before recording)
/// is `Published` again, and the message is still there.
pub async fn republish_is_published<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.publisher(), "publisher").await;
    let events = vec![traced(
        claimed_event("conformance_order", "dup", "conformance.created", 1),
        0,
    )];
    let first = publish(&publisher, &events).await;
    assert_all_published(&events, &first);
    let second = publish(&publisher, &events).await;
    assert_eq!(
        second,
        vec![Outcome::Published],
        "publishing the same event again (dedup key already seen) must count as published"
    );
    collect(target, &ids(&events), &HashSet::new()).await;
}

/// A message the broker refuses fails `Permanent`, for that message only: the others
/// of the same batch are `Published` and arrive.
pub async fn refused_message_fails_alone<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.publisher(), "publisher").await;
    let mut events: Vec<Event> = (0..5)
        .map(|i| {
            traced(
                claimed_event(
                    "conformance_order",
                    &format!("r-{i}"),
                    "conformance.created",
                    i,
                ),
                0,
            )
        })
        .collect();
    events[2] = target.refused(events[2].clone());
    let outcomes = publish(&publisher, &events).await;
    assert_eq!(
        outcomes.len(),
        events.len(),
        "one outcome per event: {outcomes:?}"
    );
    for (i, outcome) in outcomes.iter().enumerate() {
        if i == 2 {
            match outcome {
                Outcome::Failed(e) => {
                    assert_eq!(e.kind, FailureKind::Permanent, "refused message: {e:?}");
                    assert!(
                        !e.message.trim().is_empty(),
                        "refused message needs an error text"
                    );
                }
                Outcome::Published => panic!("refused message reported as published"),
            }
        } else {
            assert_eq!(
                outcome,
                &Outcome::Published,
                "event {i} next to a refused one"
            );
        }
    }
    let good: Vec<Uuid> = events
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, e)| e.id)
        .collect();
    let refused: HashSet<Uuid> = [events[2].id].into();
    collect(target, &good, &refused).await;
    // Not delivered later either: the relay dead-letters it and never sends it again.
    assert_not_received_soon(target, &refused, "refused by the broker").await;
}

/// The relay's hold-back rule with this publisher: in a claim holding a run of six
/// events of one aggregate (and events of another), the third fails, first with a
/// retryable error (injected before it reaches the broker), then, in a second
/// round, refused by the broker itself ([`ConformanceTarget::refused`]). Each time
/// the broker receives the events before it and the other aggregate's, nothing of
/// the run after it while it fails; then the rest, in order.
pub async fn failed_event_holds_back_its_run<T: ConformanceTarget>(target: &T) {
    use crate::testing::MemoryStore;
    use crate::{Relay, RelayConfig, RetryPolicy};

    for refused_by_broker in [false, true] {
        let store = MemoryStore::new();
        let mut run: Vec<Event> = (0..6)
            .map(|i| claimed_event("conformance_order", "run", "conformance.created", i))
            .collect();
        if refused_by_broker {
            run[2] = target.refused(run[2].clone());
        }
        let other: Vec<Event> = (0..3)
            .map(|i| claimed_event("conformance_order", "other", "conformance.created", i))
            .collect();
        for e in run.iter().chain(&other) {
            if let Err(error) = store.enqueue(to_new(e)) {
                panic!("cannot enqueue conformance event {}: {error}", e.id);
            }
        }
        let failing = run[2].id;
        let publisher = FailFirstAttempt {
            inner: build(target.publisher(), "publisher").await,
            id: (!refused_by_broker).then_some(failing),
            failed: std::sync::atomic::AtomicBool::new(false),
        };
        let relay = Relay::new(store.clone(), publisher).with_config(
            RelayConfig::default()
                .batch_size(100)
                .publish_timeout(PUBLISH_DEADLINE)
                .retry(
                    RetryPolicy::default()
                        .base_delay(Duration::ZERO)
                        .max_delay(Duration::ZERO),
                ),
        );
        let what = if refused_by_broker {
            "refused by the broker"
        } else {
            "retryable"
        };

        let first = match relay.run_once().await {
            Ok(report) => report,
            Err(e) => panic!("in-memory store failed: {e}"),
        };
        assert_eq!(first.claimed, 9, "one claim holds both runs");
        assert_eq!(
            (first.published, first.held_back),
            (5, 3),
            "third event {what}: two before it and the other aggregate published, three held back: {first:?}"
        );
        let mut before: Vec<Uuid> = ids(&run[..2]);
        before.extend(ids(&other));
        let held: HashSet<Uuid> = run[2..].iter().map(|e| e.id).collect();
        let received = collect_in_arrival_order(target, &before, &held).await;
        assert_not_received_soon(target, &held, what).await;

        let second = match relay.run_once().await {
            Ok(report) => report,
            Err(e) => panic!("in-memory store failed: {e}"),
        };
        let rest: Vec<Uuid> = if refused_by_broker {
            ids(&run[3..])
        } else {
            ids(&run[2..])
        };
        assert_eq!(
            second.published,
            rest.len(),
            "the rest of the run: {second:?}"
        );
        let forbidden: HashSet<Uuid> = if refused_by_broker {
            [failing].into()
        } else {
            HashSet::new()
        };
        let later = collect_in_arrival_order(target, &rest, &forbidden).await;
        let arrived: Vec<Uuid> = received
            .iter()
            .chain(&later)
            .filter(|m| m.aggregate_id == "run")
            .map(|m| m.id)
            .collect();
        let mut expected = ids(&run[..2]);
        expected.extend(&rest);
        assert_eq!(arrived, expected, "the run's order at the broker ({what})");
        if refused_by_broker {
            assert_not_received_soon(target, &forbidden, what).await;
        }
    }
}

/// Events in one aggregate's run of the hot-run checks: a full claim of the relay.
pub const HOT_RUN: usize = 200;

/// A relay over an in-memory outbox holding a hot run of [`HOT_RUN`] events of one
/// aggregate (and two events of each of three others), claimed whole, retried at once.
fn hot_run_relay<P: Publisher>(
    publisher: impl FnOnce(&[Event]) -> P,
) -> (
    crate::Relay<crate::testing::MemoryStore, P>,
    Vec<Event>,
    Vec<Event>,
) {
    use crate::testing::MemoryStore;
    use crate::{Relay, RelayConfig, RetryPolicy};

    let store = MemoryStore::new();
    let run: Vec<Event> = (0..HOT_RUN as i64)
        .map(|i| claimed_event("conformance_order", "hot", "conformance.created", i))
        .collect();
    let others: Vec<Event> = (0..6)
        .map(|i| {
            let aggregate = format!("cold-{}", i % 3);
            claimed_event("conformance_order", &aggregate, "conformance.created", i)
        })
        .collect();
    // The hot run first, so that one claim holds it whole.
    for e in run.iter().chain(&others) {
        if let Err(error) = store.enqueue(to_new(e)) {
            panic!("cannot enqueue conformance event {}: {error}", e.id);
        }
    }
    let relay = Relay::new(store, publisher(&run)).with_config(
        RelayConfig::default()
            .batch_size(HOT_RUN + others.len())
            .publish_timeout(PUBLISH_DEADLINE)
            .retry(
                RetryPolicy::default()
                    .base_delay(Duration::ZERO)
                    .max_delay(Duration::ZERO)
                    .max_attempts(100),
            ),
    );
    (relay, run, others)
}

/// Claim and publish until the outbox is empty, within [`PUBLISH_DEADLINE`]; pauses
/// briefly after a claim that published nothing (a broker coming back).
async fn drain_outbox<P: Publisher>(
    relay: &crate::Relay<crate::testing::MemoryStore, P>,
    check: &str,
) {
    let deadline = Instant::now() + PUBLISH_DEADLINE;
    loop {
        let report = match relay.run_once().await {
            Ok(report) => report,
            Err(e) => panic!("{check}: in-memory store failed: {e}"),
        };
        if report.claimed == 0 && crate::Store::pending(relay.store()).await.ok() == Some(0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{check}: outbox not drained within {PUBLISH_DEADLINE:?}: {:?}",
            relay.stats().snapshot()
        );
        if report.published == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Read back every event of `run` and `others`; the first copies of each aggregate
/// must have arrived in insertion order.
async fn assert_first_copies_in_order<T: ConformanceTarget>(
    target: &T,
    run: &[Event],
    others: &[Event],
    check: &str,
) {
    let mut all = ids(run);
    all.extend(ids(others));
    let arrivals: Vec<Uuid> = collect_in_arrival_order(target, &all, &HashSet::new())
        .await
        .iter()
        .map(|m| m.id)
        .collect();
    let mut runs = vec![ids(run)];
    for aggregate in ["cold-0", "cold-1", "cold-2"] {
        runs.push(
            others
                .iter()
                .filter(|e| e.aggregate_id == aggregate)
                .map(|e| e.id)
                .collect(),
        );
    }
    if let Err(e) = crate::testing::check_first_arrivals(&arrivals, &runs) {
        panic!("{check}: first copies at the broker: {e}");
    }
}

/// A hot run of [`HOT_RUN`] events of one aggregate, claimed whole, where event `k`
/// (at random) fails once with a retryable error, then succeeds: the relay records
/// the published head, retries from `k`, and the broker's first copies of the run are
/// in insertion order (whether the publisher pipelines runs or sends them one at a
/// time).
pub async fn hot_run_failure_keeps_order<T: ConformanceTarget>(target: &T) {
    let k = fastrand::usize(1..HOT_RUN - 1);
    let check = format!("hot_run_failure_keeps_order (event {k} fails once)");
    let inner = build(target.publisher(), "publisher").await;
    let (relay, run, others) = hot_run_relay(|run| FailFirstAttempt {
        inner,
        id: Some(run[k].id),
        failed: std::sync::atomic::AtomicBool::new(false),
    });
    drain_outbox(&relay, &check).await;
    let stats = relay.stats().snapshot();
    assert_eq!(
        (stats.published, stats.retried, stats.dead_lettered),
        ((HOT_RUN + others.len()) as u64, 1, 0),
        "{check}: every event published once recorded, one retry: {stats:?}"
    );
    assert_first_copies_in_order(target, &run, &others, &check).await;
}

/// [`hot_run_failure_keeps_order`] with the broker cut while the run is in flight
/// ([`OutageTarget::cut`] at a random point of it) and back once the relay saw the
/// failure: nothing lost, nothing dead-lettered, first copies in insertion order.
pub async fn hot_run_outage_keeps_order<T: OutageTarget>(target: &T) {
    let cut_after = fastrand::usize(1..HOT_RUN - 1);
    let check = format!("hot_run_outage_keeps_order (cut near event {cut_after})");
    let inner = build(target.outage_publisher(), "outage publisher").await;
    let publisher = CutMidRun {
        inner,
        target,
        cut_after,
        sent: std::sync::atomic::AtomicUsize::new(0),
        cut: std::sync::atomic::AtomicBool::new(false),
    };
    let (relay, run, others) = hot_run_relay(|_| publisher);
    let first = match relay.run_once().await {
        Ok(report) => report,
        Err(e) => panic!("{check}: in-memory store failed: {e}"),
    };
    target.restore();
    tracing::info!(?first, "{check}: first claim");
    drain_outbox(&relay, &check).await;
    let stats = relay.stats().snapshot();
    assert_eq!(
        (stats.published, stats.dead_lettered),
        ((HOT_RUN + others.len()) as u64, 0),
        "{check}: every event published, none dead-lettered (first claim {first:?}): {stats:?}"
    );
    assert_first_copies_in_order(target, &run, &others, &check).await;
}

/// Cuts the broker ([`OutageTarget::cut`]) once, while about the `cut_after`-th
/// event of the claim is being sent: before the wave that holds it when runs go out
/// one event at a time, at a random instant of the run's call when it is pipelined.
struct CutMidRun<'t, P, T> {
    inner: P,
    target: &'t T,
    cut_after: usize,
    sent: std::sync::atomic::AtomicUsize,
    cut: std::sync::atomic::AtomicBool,
}

impl<P: Publisher, T: OutageTarget> CutMidRun<'_, P, T> {
    fn cut_once(&self) {
        if !self.cut.swap(true, std::sync::atomic::Ordering::SeqCst) {
            self.target.cut();
        }
    }
}

impl<P: Publisher, T: OutageTarget> Publisher for CutMidRun<'_, P, T> {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        use std::sync::atomic::Ordering;
        let before = self.sent.fetch_add(events.len(), Ordering::SeqCst);
        if before + events.len() > self.cut_after {
            self.cut_once();
        }
        self.inner.publish(events).await
    }

    async fn check(&self) -> Result<(), crate::PublishError> {
        self.inner.check().await
    }

    fn run_order(&self) -> RunOrder {
        self.inner.run_order()
    }

    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        if self.cut.load(std::sync::atomic::Ordering::SeqCst) {
            return self.inner.publish_run(run).await;
        }
        // Somewhere in the first milliseconds of the run: the messages in flight then
        // are lost, refused or stored; which of them varies from run to run.
        let delay = Duration::from_micros(fastrand::u64(0..3_000));
        let (outcome, ()) = tokio::join!(self.inner.publish_run(run), async {
            tokio::time::sleep(delay).await;
            self.cut_once();
        });
        outcome
    }
}

/// Fails event `id` with a retryable error on its first attempt, without sending it.
struct FailFirstAttempt<P> {
    inner: P,
    id: Option<Uuid>,
    failed: std::sync::atomic::AtomicBool,
}

impl<P: Publisher> Publisher for FailFirstAttempt<P> {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        use std::sync::atomic::Ordering;
        let position = self
            .id
            .and_then(|id| events.iter().position(|e| e.id == id))
            .filter(|_| !self.failed.swap(true, Ordering::SeqCst));
        let Some(position) = position else {
            return self.inner.publish(events).await;
        };
        let rest: Vec<Event> = events
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != position)
            .map(|(_, e)| e.clone())
            .collect();
        let mut outcomes = self.inner.publish(&rest).await;
        outcomes.insert(
            position.min(outcomes.len()),
            Outcome::retryable("conformance: injected failure"),
        );
        outcomes
    }

    async fn check(&self) -> Result<(), crate::PublishError> {
        self.inner.check().await
    }

    fn run_order(&self) -> RunOrder {
        self.inner.run_order()
    }

    /// The run's head before event `id` goes to the broker, pipelined; `id` fails.
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        use std::sync::atomic::Ordering;
        let position = self
            .id
            .and_then(|id| run.iter().position(|e| e.id == id))
            .filter(|_| !self.failed.swap(true, Ordering::SeqCst));
        let Some(position) = position else {
            return self.inner.publish_run(run).await;
        };
        let head = self.inner.publish_run(&run[..position]).await;
        if head.failure.is_some() {
            return head;
        }
        RunOutcome::failed(
            position,
            crate::PublishError::retryable("conformance: injected failure"),
        )
    }
}

/// The event as written to the outbox, for enqueueing it into the in-memory store.
fn to_new(e: &Event) -> crate::NewEvent {
    crate::NewEvent {
        id: e.id,
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        event_type: e.event_type.clone(),
        payload: e.payload_str().to_string(),
        headers: e.headers.clone(),
        destination: e.destination.clone(),
        not_before: None,
    }
}

/// Read for a few seconds and fail if any of `ids` arrives.
async fn assert_not_received_soon<T: ConformanceTarget>(
    target: &T,
    ids: &HashSet<Uuid>,
    what: &str,
) {
    let until = Instant::now() + NOT_RECEIVED_WAIT;
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        let wait = left.min(Duration::from_millis(500));
        receive_none_of(
            target,
            100,
            wait,
            left,
            ids,
            &format!("held back or refused ({what})"),
        )
        .await;
    }
}

/// One [`ConformanceTarget::receive`] of up to `max` messages waiting at most
/// `wait`, which must return within `left` and a margin; fails when a message of
/// `forbidden` arrives, saying it should have been `kept`.
async fn receive_none_of<T: ConformanceTarget>(
    target: &T,
    max: usize,
    wait: Duration,
    left: Duration,
    forbidden: &HashSet<Uuid>,
    kept: &str,
) -> Vec<ReceivedMessage> {
    let batch = match tokio::time::timeout(left + Duration::from_secs(5), target.receive(max, wait))
        .await
    {
        Ok(Ok(batch)) => batch,
        Ok(Err(e)) => panic!("cannot read messages back: {e}"),
        Err(_) => panic!("receive ignored its wait of {wait:?}"),
    };
    for message in &batch {
        assert!(
            !forbidden.contains(&message.id),
            "message {} arrived although it should have been {kept}",
            message.id
        );
    }
    batch
}

/// A broker that cannot be reached gives [`FailureKind::Unavailable`] failures (one per
/// event, so that the relay counts no attempt against them) within
/// [`UNREACHABLE_DEADLINE`]; `check` fails with `Unavailable` too; nothing panics or
/// hangs.
pub async fn unreachable_broker_is_unavailable<T: ConformanceTarget>(target: &T) {
    let publisher = build(target.unreachable_publisher(), "unreachable publisher").await;
    let events: Vec<Event> = (0..3)
        .map(|i| claimed_event("conformance_order", "down", "conformance.created", i))
        .collect();
    let started = Instant::now();
    let outcomes = tokio::time::timeout(UNREACHABLE_DEADLINE, publisher.publish(&events))
        .await
        .unwrap_or_else(|_| {
            panic!("publish to an unreachable broker hung for {UNREACHABLE_DEADLINE:?}")
        });
    assert_eq!(
        outcomes.len(),
        events.len(),
        "one outcome per event: {outcomes:?}"
    );
    for outcome in &outcomes {
        match outcome {
            Outcome::Failed(e) => assert_eq!(e.kind, FailureKind::Unavailable, "{e:?}"),
            Outcome::Published => panic!("published to an unreachable broker"),
        }
    }
    let check = tokio::time::timeout(UNREACHABLE_DEADLINE, publisher.check())
        .await
        .unwrap_or_else(|_| {
            panic!("check of an unreachable broker hung for {UNREACHABLE_DEADLINE:?}")
        });
    match check {
        Err(e) => assert_eq!(e.kind, FailureKind::Unavailable, "check: {e:?}"),
        Ok(()) => panic!("check passed for an unreachable broker"),
    }
    tracing::debug!(elapsed = ?started.elapsed(), "unreachable broker reported");
}

async fn build<P>(fut: impl Future<Output = Result<P, BoxError>>, what: &str) -> P {
    match tokio::time::timeout(PUBLISH_DEADLINE, fut).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => panic!("cannot build the {what}: {e}"),
        Err(_) => panic!("building the {what} took over {PUBLISH_DEADLINE:?}"),
    }
}

async fn publish<P: Publisher>(publisher: &P, events: &[Event]) -> Vec<Outcome> {
    tokio::time::timeout(PUBLISH_DEADLINE, publisher.publish(events))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "publish of {} events took over {PUBLISH_DEADLINE:?}",
                events.len()
            )
        })
}

fn ids(events: &[Event]) -> Vec<Uuid> {
    events.iter().map(|e| e.id).collect()
}

fn assert_all_published(events: &[Event], outcomes: &[Outcome]) {
    assert_eq!(
        outcomes.len(),
        events.len(),
        "one outcome per event, got {outcomes:?}"
    );
    for (event, outcome) in events.iter().zip(outcomes) {
        assert_eq!(
            outcome,
            &Outcome::Published,
            "event {} ({})",
            event.id,
            event.event_type
        );
    }
}

/// Read until every id in `expected` arrived; returned in the order of `expected`.
async fn collect<T: ConformanceTarget>(
    target: &T,
    expected: &[Uuid],
    forbidden: &HashSet<Uuid>,
) -> Vec<ReceivedMessage> {
    let mut by_id: HashMap<Uuid, ReceivedMessage> =
        collect_in_arrival_order(target, expected, forbidden)
            .await
            .into_iter()
            .map(|m| (m.id, m))
            .collect();
    expected.iter().filter_map(|id| by_id.remove(id)).collect()
}

/// Read until every id in `expected` arrived; first copies, in arrival order.
async fn collect_in_arrival_order<T: ConformanceTarget>(
    target: &T,
    expected: &[Uuid],
    forbidden: &HashSet<Uuid>,
) -> Vec<ReceivedMessage> {
    let wanted: HashSet<Uuid> = expected.iter().copied().collect();
    let mut seen: HashSet<Uuid> = HashSet::new();
    let mut received = Vec::new();
    let deadline = Instant::now() + RECEIVE_TIMEOUT;
    while seen.len() < wanted.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let missing: Vec<&Uuid> = expected.iter().filter(|id| !seen.contains(id)).collect();
            panic!(
                "{} of {} messages not received within {RECEIVE_TIMEOUT:?}: {missing:?}",
                missing.len(),
                expected.len()
            );
        }
        let wait = left.min(Duration::from_secs(2));
        let max = wanted.len() - seen.len();
        for message in receive_none_of(target, max, wait, left, forbidden, "refused").await {
            if wanted.contains(&message.id) && seen.insert(message.id) {
                received.push(message);
            }
        }
    }
    received
}
