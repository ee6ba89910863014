//! Publisher conformance through the real relay and the real PostgreSQL store: the
//! checks a broker crate runs besides `pgoutbox_core::conformance_tests!`, with the
//! same [`ConformanceTarget`], as one `#[tokio::test]` each with
//! [`relay_conformance_tests!`](crate::relay_conformance_tests).
//!
//! Not a stable API: checks are added and tightened as the publisher contract grows.

use std::collections::HashSet;
use std::future::Future;
use std::time::{Duration, Instant};

use pgoutbox_core::conformance::{
    ConformanceTarget, OutageTarget, ReceivedMessage, NOT_RECEIVED_WAIT, RECEIVE_TIMEOUT,
};
use pgoutbox_core::testing::{check_first_arrivals, hold_outage, run_relay_while};
use pgoutbox_core::{DeadLetterFilter, NewEvent, Publisher, Relay, Store, TRACEPARENT};
use uuid::Uuid;

use crate::testing::{broker_relay_config, TestOutbox, Writer};

/// Longest a whole check may take.
const DEADLINE: Duration = Duration::from_secs(120);

/// Longest a refused event may take to become a dead letter once the events
/// around it arrived: with reading them back ([`RECEIVE_TIMEOUT`]) and the late
/// arrivals' wait, it ends before [`DEADLINE`].
const DEAD_LETTER_WITHIN: Duration = Duration::from_secs(60);
const _: () = assert!(
    RECEIVE_TIMEOUT.as_secs() + DEAD_LETTER_WITHIN.as_secs() + NOT_RECEIVED_WAIT.as_secs()
        < DEADLINE.as_secs()
);

/// Longest the relay may take to see a broker that is down as an outage.
/// The broker cut in the middle of a hot aggregate's run (from the publisher suite;
/// run here with the other outage checks).
pub use pgoutbox_core::conformance::hot_run_outage_keeps_order;

const OUTAGE_SEEN_WITHIN: Duration = Duration::from_secs(15);

const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// One `#[tokio::test]` per check of this module, each on a fresh target (the same
/// forms as `pgoutbox_core::conformance_tests!`): `relay_conformance_tests!(make)` or
/// `relay_conformance_tests!(make, cleanup)` run [`relay_end_to_end`],
/// [`relay_refused_event_is_a_dead_letter_alone`] and, for a target that is an
/// [`OutageTarget`], [`relay_outage_loses_nothing`] and the publisher suite's
/// [`hot_run_outage_keeps_order`];
/// `relay_conformance_tests!(make, cleanup, no_outage)` leaves the outage out, for a
/// broker a test cannot take away (say why where you use it);
/// `relay_conformance_tests!(make, cleanup, wal)` runs the end-to-end and refused
/// checks in WAL mode (feature `wal`, `wal_level = logical`). Needs PostgreSQL at
/// `DATABASE_URL`.
#[macro_export]
macro_rules! relay_conformance_tests {
    ($make:expr) => {
        $crate::relay_conformance_tests!($make, |_| async {});
    };
    ($make:expr, $cleanup:expr) => {
        $crate::__core::conformance_tests!(@checks_of $crate; $make, $cleanup;
            relay_end_to_end, relay_refused_event_is_a_dead_letter_alone,
            relay_outage_loses_nothing, hot_run_outage_keeps_order);
    };
    ($make:expr, $cleanup:expr, no_outage) => {
        $crate::__core::conformance_tests!(@checks_of $crate; $make, $cleanup;
            relay_end_to_end, relay_refused_event_is_a_dead_letter_alone);
    };
    // The same checks in WAL mode (feature `wal`; `wal_level = logical`).
    ($make:expr, $cleanup:expr, wal) => {
        $crate::__core::conformance_tests!(@checks_of $crate; $make, $cleanup;
            wal_relay_end_to_end, wal_relay_refused_event_is_a_dead_letter_alone);
    };
}

/// Every check for a broker that runs them all, one `#[tokio::test]` each: the
/// publisher suite of `pgoutbox_core::conformance_tests!` with the default envelope
/// and once per CloudEvents content mode (`@envelopes`), and
/// [`relay_conformance_tests!`](crate::relay_conformance_tests) in table mode
/// (outage included) and in WAL mode (feature `wal`, `wal_level = logical`).
/// `with_envelope` is a function from an `Envelope` to a future of a fresh target
/// whose publisher encodes with it; `cleanup` as in
/// [`relay_conformance_tests!`](crate::relay_conformance_tests).
///
/// ```text
/// pgoutbox_postgres::broker_conformance_tests!(MyBroker::with_envelope, |b: MyBroker| async move {
///     b.delete().await
/// });
/// ```
#[macro_export]
macro_rules! broker_conformance_tests {
    ($with_envelope:expr, $cleanup:expr) => {
        $crate::__core::conformance_tests!(
            ($with_envelope)($crate::__core::envelope::Envelope::Outbox).await,
            $cleanup
        );
        $crate::relay_conformance_tests!(
            ($with_envelope)($crate::__core::envelope::Envelope::Outbox).await,
            $cleanup
        );
        $crate::__core::conformance_tests!(@envelopes $with_envelope, $cleanup);
        // WAL mode: events written to the WAL, read from a replication slot.
        $crate::relay_conformance_tests!(
            ($with_envelope)($crate::__core::envelope::Envelope::Outbox).await,
            $cleanup,
            wal
        );
    };
}

/// Events committed in PostgreSQL transactions reach the broker through the relay:
/// 4 aggregates x 6 events over three transactions, interleaved, each with a
/// `traceparent`; a fourth transaction is rolled back. Every committed event is
/// read back, its header intact, each aggregate's first copies in insertion order;
/// the rolled-back event never arrives; the outbox is empty afterwards.
pub async fn relay_end_to_end<T: ConformanceTarget>(target: &T) {
    end_to_end(target, &Setup::table(target).await).await;
}

/// [`relay_end_to_end`] in WAL mode: events written with `WalOutbox`, read from a
/// slot of the check's own through `WalStore` (needs `wal_level = logical`).
#[cfg(feature = "wal")]
pub async fn wal_relay_end_to_end<T: ConformanceTarget>(target: &T) {
    end_to_end(target, &Setup::wal(target).await).await;
}

/// What a relay check runs on: a fresh outbox, how the check writes its events,
/// and a relay from where they are read to the target's publisher.
struct Setup<S: Store, P: Publisher> {
    db: TestOutbox,
    writer: Writer,
    relay: Relay<S, P>,
    /// The slot the relay reads in WAL mode, dropped after the check.
    #[cfg(feature = "wal")]
    _slot: Option<crate::testing::TestSlot>,
}

impl<P: Publisher> Setup<crate::PgStore, P> {
    /// Events written into the outbox table, read from it.
    async fn table<T: ConformanceTarget<Publisher = P>>(target: &T) -> Self {
        let db = fresh_outbox().await;
        Self {
            relay: relay_to(target, db.store()).await,
            db,
            writer: Writer::Table,
            #[cfg(feature = "wal")]
            _slot: None,
        }
    }
}

#[cfg(feature = "wal")]
impl<P: Publisher> Setup<crate::wal::WalStore, P> {
    /// Events written to the WAL, read from a slot of the check's own.
    async fn wal<T: ConformanceTarget<Publisher = P>>(target: &T) -> Self {
        let db = fresh_outbox().await;
        let slot = crate::testing::TestSlot::create(&db).await;
        let store = crate::wal::WalStore::new(db.pool.clone(), db.tables.clone(), slot.source());
        Self {
            relay: relay_to(target, store).await,
            db,
            writer: Writer::Wal,
            _slot: Some(slot),
        }
    }
}

/// A fresh outbox for a check.
async fn fresh_outbox() -> TestOutbox {
    TestOutbox::new().await.expect("PostgreSQL at DATABASE_URL")
}

/// A relay from `store` to `target`'s publisher, configured for a real broker.
async fn relay_to<T: ConformanceTarget, S: Store>(target: &T, store: S) -> Relay<S, T::Publisher> {
    let publisher = target.publisher().await.expect("publisher");
    Relay::new(store, publisher).with_config(broker_relay_config())
}

/// A `conformance.order.changed` event of the `conformance_order` aggregate
/// `aggregate`.
fn order_changed(aggregate: &str, payload: serde_json::Value) -> NewEvent {
    NewEvent::new(
        "conformance_order",
        aggregate,
        "conformance.order.changed",
        &payload,
    )
}

async fn end_to_end<T: ConformanceTarget, S: Store>(target: &T, setup: &Setup<S, T::Publisher>) {
    let Setup {
        db, writer, relay, ..
    } = setup;
    let mut runs: Vec<Vec<Uuid>> = vec![Vec::new(); 4];
    for tx in 0..3 {
        let events: Vec<NewEvent> = (0..8)
            .map(|i| {
                let aggregate = format!("o-{}", i % 4);
                order_changed(&aggregate, serde_json::json!({ "tx": tx, "i": i }))
                    .with_traceparent(TRACE)
            })
            .collect();
        db.write(*writer, &events, true).await.expect("enqueue");
        for (i, event) in events.iter().enumerate() {
            runs[i % 4].push(event.id);
        }
    }
    let ghost = order_changed("o-0", serde_json::json!({ "rolled back": true }));
    db.write(*writer, std::slice::from_ref(&ghost), false)
        .await
        .expect("enqueue");

    let wanted: HashSet<Uuid> = runs.iter().flatten().copied().collect();
    let read = async {
        let messages = read_back("relay_end_to_end", target, &wanted, Some(ghost.id)).await;
        for message in &messages {
            assert_eq!(
                message.headers.get(TRACEPARENT).map(String::as_str),
                Some(TRACE),
                "relay_end_to_end: event {} lost its traceparent",
                message.id
            );
        }
        // A late copy of the rolled-back event would show up now.
        with_late_arrivals(target, &messages).await
    };
    let arrivals = while_relaying("relay_end_to_end", relay, read).await;
    check_first_arrivals(&arrivals, &runs)
        .unwrap_or_else(|e| panic!("relay_end_to_end: per-aggregate order: {e}"));
    assert!(
        !arrivals.contains(&ghost.id),
        "relay_end_to_end: an event of a rolled-back transaction was published"
    );
    let pending = relay.store().pending().await.expect("pending");
    assert_eq!(pending, 0, "relay_end_to_end: events left in the outbox");
    let parked = db.store().pending().await.expect("pending");
    assert_eq!(
        parked, 0,
        "relay_end_to_end: events left in the outbox table"
    );
    db.drop_schema().await.expect("drop schema");
}

/// An event the broker refuses for good ([`ConformanceTarget::refused`]), stored in
/// PostgreSQL like any other, is dead-lettered after one attempt with the broker's
/// reason, and holds back its own aggregate only: the aggregate's next event stays
/// pending (the default `AfterDeadLetter::Block`), events of other aggregates,
/// before and after it in the table, are published.
pub async fn relay_refused_event_is_a_dead_letter_alone<T: ConformanceTarget>(target: &T) {
    refused_event_is_a_dead_letter_alone(target, &Setup::table(target).await).await;
}

/// [`relay_refused_event_is_a_dead_letter_alone`] in WAL mode: the refused event is
/// parked in the outbox table as a dead letter, its follower behind it.
#[cfg(feature = "wal")]
pub async fn wal_relay_refused_event_is_a_dead_letter_alone<T: ConformanceTarget>(target: &T) {
    refused_event_is_a_dead_letter_alone(target, &Setup::wal(target).await).await;
}

async fn refused_event_is_a_dead_letter_alone<T: ConformanceTarget, S: Store>(
    target: &T,
    setup: &Setup<S, T::Publisher>,
) {
    let Setup {
        db, writer, relay, ..
    } = setup;
    let new = |aggregate: &str, n: i64| order_changed(aggregate, serde_json::json!({ "n": n }));
    // The refused event as the target makes it, back into a `NewEvent`.
    let refused = {
        let event = target.refused(pgoutbox_core::conformance::claimed_event(
            "conformance_order",
            "poison",
            "conformance.order.changed",
            0,
        ));
        let payload: serde_json::Value =
            serde_json::from_str(event.payload_str()).expect("the refused event's JSON");
        let mut new = NewEvent::new(
            &event.aggregate_type,
            &event.aggregate_id,
            &event.event_type,
            &payload,
        );
        if let Some(destination) = &event.destination {
            new = new.with_destination(destination);
        }
        new
    };
    let follower = new("poison", 1);
    let events = vec![new("a", 0), refused.clone(), follower.clone(), new("b", 0)];
    db.write(*writer, &events, true).await.expect("enqueue");
    let good: HashSet<Uuid> = [events[0].id, events[3].id].into_iter().collect();
    let dead = crate::DeadLetters::new(db.pool.clone(), &db.outbox);

    let work = async {
        let received = read_back(
            "relay_refused_event_is_a_dead_letter_alone",
            target,
            &good,
            Some(refused.id),
        )
        .await;
        // The broker refuses the event for good: a dead letter on the first try
        // (asserted below), so soon after the other events arrived. Bounded to end
        // inside the check's own `DEADLINE`, so that a slow dead letter is reported
        // as one, with what the relay saw, not as a relay that did not stop.
        let limit = DEAD_LETTER_WITHIN;
        let deadline = Instant::now() + limit;
        while dead
            .count(&DeadLetterFilter::default())
            .await
            .expect("dead letters")
            == 0
        {
            assert!(
                Instant::now() < deadline,
                "relay_refused_event_is_a_dead_letter_alone: no dead letter within {limit:?} \
                 (relay: {:?}, broker: {:?})",
                relay.stats().snapshot(),
                relay.broker_health().status()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Whatever a broker might still deliver late.
        with_late_arrivals(target, &received).await
    };
    let received = while_relaying("relay_refused_event_is_a_dead_letter_alone", relay, work).await;
    assert!(
        !received.contains(&refused.id),
        "relay_refused_event_is_a_dead_letter_alone: the refused event was delivered"
    );
    assert!(
        !received.contains(&follower.id),
        "relay_refused_event_is_a_dead_letter_alone: the dead letter's follower overtook it"
    );
    let letter = dead
        .show(refused.id)
        .await
        .expect("show")
        .unwrap_or_else(|| {
            panic!(
                "relay_refused_event_is_a_dead_letter_alone: the refused event is no dead letter"
            )
        });
    assert_eq!(
        letter.event.attempts, 1,
        "relay_refused_event_is_a_dead_letter_alone: a permanent failure was retried"
    );
    assert!(
        letter
            .last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("permanent")),
        "relay_refused_event_is_a_dead_letter_alone: last error {:?}",
        letter.last_error
    );
    assert_eq!(
        db.store().pending().await.expect("pending"),
        1,
        "relay_refused_event_is_a_dead_letter_alone: only the follower should be pending"
    );
    assert_eq!(
        relay.store().pending().await.expect("pending"),
        if *writer == Writer::Table { 1 } else { 0 },
        "relay_refused_event_is_a_dead_letter_alone: events left unresolved"
    );
    db.drop_schema().await.expect("drop schema");
}

/// Run `relay` while `work` runs, at most [`DEADLINE`]; what `work` returned.
async fn while_relaying<S: Store, P: Publisher, W>(
    check: &str,
    relay: &Relay<S, P>,
    work: impl Future<Output = W>,
) -> W {
    run_relay_while(relay, work, DEADLINE)
        .await
        .unwrap_or_else(|| panic!("{check}: the relay did not stop in time"))
}

/// The ids of `messages`, then of what `target` still delivers within
/// [`NOT_RECEIVED_WAIT`]: a late copy of something that should not arrive would
/// show up now.
async fn with_late_arrivals<T: ConformanceTarget>(
    target: &T,
    messages: &[ReceivedMessage],
) -> Vec<Uuid> {
    let late = target.receive(100, NOT_RECEIVED_WAIT).await;
    let late = late.expect("receive");
    messages.iter().chain(&late).map(|m| m.id).collect()
}

/// Read until every id of `wanted` arrived, at most [`RECEIVE_TIMEOUT`]; returns
/// the messages of `wanted` (and of `also`), copies included, in arrival order.
async fn read_back<T: ConformanceTarget>(
    check: &str,
    target: &T,
    wanted: &HashSet<Uuid>,
    also: Option<Uuid>,
) -> Vec<ReceivedMessage> {
    let mut messages = Vec::new();
    let mut seen = HashSet::new();
    let deadline = Instant::now() + RECEIVE_TIMEOUT;
    while !wanted.is_subset(&seen) {
        assert!(
            Instant::now() < deadline,
            "{check}: {} of {} events read back within {RECEIVE_TIMEOUT:?}",
            wanted.intersection(&seen).count(),
            wanted.len()
        );
        for message in target
            .receive(100, Duration::from_millis(500))
            .await
            .expect("receive")
        {
            if wanted.contains(&message.id) || also == Some(message.id) {
                seen.insert(message.id);
                messages.push(message);
            }
        }
    }
    messages
}

/// A broker outage longer than the whole retry schedule (3 attempts, 50-300 ms
/// apart) loses nothing and dead-letters nothing: the relay sees the outage, counts
/// no attempt, keeps every event pending and its publisher's check failing while
/// it lasts, and once the broker is back publishes everything, each aggregate's
/// first copies in insertion order.
pub async fn relay_outage_loses_nothing<T: OutageTarget>(target: &T) {
    let db = fresh_outbox().await;
    let publisher = target.outage_publisher().await.expect("outage publisher");
    let mut config = broker_relay_config();
    config.retry = config.retry.max_attempts(3);
    config.broker_probe_min = Duration::from_millis(100);
    config.broker_probe_max = Duration::from_millis(500);
    let relay = Relay::new(db.store(), publisher).with_config(config);
    let health = relay.broker_health();

    target.cut();
    let events: Vec<NewEvent> = (0..12)
        .map(|i| order_changed(&format!("o-{}", i % 4), serde_json::json!({ "i": i })))
        .collect();
    db.enqueue_committed(&events).await.expect("enqueue");
    let runs: Vec<Vec<Uuid>> = (0..4)
        .map(|a| events.iter().skip(a).step_by(4).map(|e| e.id).collect())
        .collect();
    let wanted: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let attempts_table = format!(
        "{}.{}",
        db.tables.schema().quoted(),
        db.tables.events().quoted()
    );

    let work = async {
        // Outlast the retry schedule many times over.
        hold_outage(&health, Duration::from_secs(3), OUTAGE_SEEN_WITHIN)
            .await
            .unwrap_or_else(|e| panic!("relay_outage_loses_nothing: {e}"));
        let attempts: i64 = sqlx::query_scalar(&format!(
            "SELECT coalesce(sum(attempts), 0) FROM {attempts_table}"
        ))
        .fetch_one(&db.pool)
        .await
        .expect("attempts");
        assert_eq!(
            attempts, 0,
            "relay_outage_loses_nothing: the outage counted attempts"
        );
        assert!(
            relay.publisher().check().await.is_err(),
            "relay_outage_loses_nothing: the publisher's check passed during the outage"
        );
        assert_eq!(
            relay.store().pending().await.expect("pending"),
            events.len() as u64,
            "relay_outage_loses_nothing: events left the outbox during the outage"
        );

        target.restore();
        read_back("relay_outage_loses_nothing", target, &wanted, None)
            .await
            .iter()
            .map(|m| m.id)
            .collect::<Vec<Uuid>>()
    };
    let arrivals = while_relaying("relay_outage_loses_nothing", &relay, work).await;
    check_first_arrivals(&arrivals, &runs)
        .unwrap_or_else(|e| panic!("relay_outage_loses_nothing: per-aggregate order: {e}"));
    let dead = crate::DeadLetters::new(db.pool.clone(), &db.outbox)
        .count(&DeadLetterFilter::default())
        .await
        .expect("dead letters");
    assert_eq!(
        dead, 0,
        "relay_outage_loses_nothing: the outage made dead letters"
    );
    db.drop_schema().await.expect("drop schema");
}
