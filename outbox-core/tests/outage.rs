//! Broker outages against the in-memory store: an outage counts no attempt, pauses
//! claiming, and ends when the probe passes and the broker takes messages.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use pgoutbox_core::testing::{
    check_first_arrivals, interleaved_events, run_relay_while, MemoryStore,
};
use pgoutbox_core::{
    BrokerStatus, Event, NewEvent, Outcome, PublishError, Publisher, Relay, RelayConfig,
    RetryPolicy,
};
use uuid::Uuid;

/// How the stand-in broker fails while it is down.
#[derive(Clone, Copy)]
enum Symptom {
    /// It says so: every message fails with [`pgoutbox_core::FailureKind::Unavailable`].
    Unavailable,
    /// It cannot tell: every message fails retryably; only the check shows the outage.
    Retryable,
}

/// A broker that can be taken down and brought back; rejects oversized events
/// permanently whether up or down, like a broker that checks size before sending.
struct Broker {
    down: AtomicBool,
    symptom: Symptom,
    published: Mutex<Vec<Event>>,
    calls: AtomicUsize,
    checks: AtomicUsize,
}

impl Broker {
    fn new(symptom: Symptom) -> Self {
        Self {
            down: AtomicBool::new(true),
            symptom,
            published: Mutex::default(),
            calls: AtomicUsize::new(0),
            checks: AtomicUsize::new(0),
        }
    }

    fn published(&self) -> Vec<Event> {
        self.published.lock().unwrap().clone()
    }
}

impl Publisher for Broker {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let down = self.down.load(Ordering::SeqCst);
        events
            .iter()
            .map(|event| {
                if event.event_type == "oversized" {
                    Outcome::permanent("message too large")
                } else if down {
                    match self.symptom {
                        Symptom::Unavailable => Outcome::unavailable("connection refused"),
                        Symptom::Retryable => Outcome::retryable("no ack in time"),
                    }
                } else {
                    self.published.lock().unwrap().push(event.clone());
                    Outcome::Published
                }
            })
            .collect()
    }

    async fn check(&self) -> Result<(), PublishError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            Err(PublishError::unavailable("connection refused"))
        } else {
            Ok(())
        }
    }
}

fn config() -> RelayConfig {
    RelayConfig::default()
        .batch_size(50)
        .workers(2)
        .poll_interval(Duration::from_millis(10))
        // Three attempts, no backoff: without outage handling, three claims of a down
        // broker would dead-letter everything.
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .base_delay(Duration::ZERO)
                .max_delay(Duration::ZERO),
        )
        .broker_probe_min(Duration::from_millis(5))
        .broker_probe_max(Duration::from_millis(40))
}

/// Wait (bounded) until `done` holds.
async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Enqueue `per_aggregate` events on each of `aggregates` aggregates, interleaved;
/// their ids in insertion order.
fn fill(store: &MemoryStore, aggregates: usize, per_aggregate: usize) -> Vec<Uuid> {
    interleaved_events("order-", aggregates, per_aggregate)
        .into_iter()
        .map(|event| store.enqueue(event).unwrap())
        .collect()
}

async fn outage_counts_no_attempt(symptom: Symptom) {
    let store = MemoryStore::new();
    let ids = fill(&store, 8, 5);
    let oversized = store
        .enqueue(NewEvent::new(
            "order",
            "order-big",
            "oversized",
            &serde_json::json!({}),
        ))
        .unwrap();
    let relay = Relay::new(store.clone(), Broker::new(symptom)).with_config(config());
    let broker = relay.publisher();
    let health = relay.broker_health();

    let scenario = async {
        wait_until("the relay sees the broker down", || !health.is_up()).await;
        // Probes go on while claiming stays paused.
        let calls = broker.calls.load(Ordering::SeqCst);
        let checks = broker.checks.load(Ordering::SeqCst);
        wait_until("the relay probed three more times", || {
            broker.checks.load(Ordering::SeqCst) >= checks + 3
        })
        .await;
        assert!(
            matches!(health.status(), BrokerStatus::Down { .. }),
            "still down: {:?}",
            health.status()
        );
        assert!(
            broker.calls.load(Ordering::SeqCst) <= calls + 2,
            "claiming goes on while the broker is down: {} publish calls, then {}",
            calls,
            broker.calls.load(Ordering::SeqCst)
        );
        for id in &ids {
            assert_eq!(
                store.attempts(*id).unwrap().0,
                0,
                "the outage counted an attempt"
            );
        }
        // The permanent failure of one message is not the broker's: dead-lettered alone.
        assert_eq!(store.dead_letter_ids(), vec![oversized]);

        broker.down.store(false, Ordering::SeqCst);
        wait_until("the outbox drained", || {
            store.published_ids().len() == ids.len()
        })
        .await;
        wait_until("the relay sees the broker up", || health.is_up()).await;
    };
    run_relay_while(&relay, scenario, Duration::from_secs(30))
        .await
        .expect("scenario finished");

    assert_eq!(store.dead_letter_ids(), vec![oversized]);
    for id in &ids {
        assert_eq!(
            store.attempts(*id).unwrap(),
            (1, None),
            "one attempt: the one that went through"
        );
    }
    // Per-aggregate order: each aggregate's events went out once, in insertion order.
    let sent: Vec<Uuid> = broker.published().iter().map(|e| e.id).collect();
    assert_eq!(sent.len(), ids.len(), "each event once");
    let runs: Vec<Vec<Uuid>> = (0..8)
        .map(|a| (0..5).map(|n| ids[n * 8 + a]).collect())
        .collect();
    check_first_arrivals(&sent, &runs).unwrap();
}

#[tokio::test]
async fn an_outage_the_broker_reports_counts_no_attempt() {
    outage_counts_no_attempt(Symptom::Unavailable).await;
}

#[tokio::test]
async fn an_outage_only_the_check_shows_counts_no_attempt() {
    outage_counts_no_attempt(Symptom::Retryable).await;
}

/// A broker that answers its check but fails every message still dead-letters them
/// after `max_attempts`: the check tells an outage from failing messages.
#[tokio::test]
async fn failing_messages_of_a_healthy_broker_still_reach_their_dead_letter() {
    struct Refuses;
    impl Publisher for Refuses {
        async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
            vec![Outcome::retryable("nacked"); events.len()]
        }
    }
    let store = MemoryStore::new();
    let ids = fill(&store, 3, 1);
    let relay = Relay::new(store.clone(), Refuses).with_config(config());
    for _ in 0..3 {
        store.make_all_due();
        let report = relay.run_once().await.unwrap();
        assert_eq!(report.deferred, 0);
    }
    assert!(relay.broker_health().is_up());
    let mut dead = store.dead_letter_ids();
    dead.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(dead, expected);
}
