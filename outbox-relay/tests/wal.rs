//! The `outbox` binary in WAL mode (`[wal] enabled`) against the real PostgreSQL
//! (`wal_level = logical`, set by scripts/test.sh) and NATS: `migrate` creates the
//! slot, the relay publishes what committed transactions wrote with `WalOutbox`,
//! in commit order per aggregate, never what rolled back, and `stats` shows the
//! slot's lag.
#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::time::Duration;

use common::{
    assert_delivered, command, receive, run_ok, runs_of, stream_consumer, Config, DropSlot,
    RelayProcess,
};
use pgoutbox_core::testing::event;
use pgoutbox_core::NewEvent;
use pgoutbox_postgres::testing::{TestOutbox, Writer};
use pgoutbox_postgres::wal::WalOutbox;
use pgoutbox_postgres::Ident;
use uuid::Uuid;

/// The binary in WAL mode on `outbox`, publishing to a NATS stream of its own,
/// reading a slot of its own (dropped at the end of the test, also when it fails).
struct WalToNats {
    config: Config,
    slot: Ident,
    stream: String,
    _cleanup: DropSlot,
}

fn wal_to_nats(outbox: &TestOutbox, name: &str) -> WalToNats {
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let slot = Ident::new("slot", &format!("outbox_test_wal_{tag}")).unwrap();
    let stream = format!("OUTBOX_{}_TEST_{tag}", name.to_uppercase());
    let config = Config::with_broker(
        outbox.tables.schema().as_str(),
        "0",
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nsubject_prefix = \"{name}test{tag}\"\n\
             ensure_stream = \"{stream}\"\n\
             [wal]\nenabled = true\nslot = \"{slot}\"\npublication = \"{slot}\"\n"
        ),
    );
    WalToNats {
        config,
        _cleanup: DropSlot(slot.clone()),
        slot,
        stream,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_binary_publishes_committed_wal_events_in_commit_order() {
    let outbox = TestOutbox::new().await.unwrap();
    let WalToNats {
        config,
        slot: slot_name,
        stream,
        _cleanup,
    } = wal_to_nats(&outbox, "wal");

    // Without its slot, the relay says what to do.
    let missing = command(&config.path, &["relay"]).output().unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&missing.stderr)
            .contains("run `outbox migrate` with [wal] enabled"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
    let migrated = run_ok(&config.path, &["migrate"]);
    assert!(
        migrated.contains(&format!("replication slot {slot_name} created")),
        "{migrated}"
    );
    assert!(run_ok(&config.path, &["migrate"]).contains("exists"));

    // Written before the relay starts: read from the slot's start.
    let first = [event("a", 1), event("b", 1), event("a", 2)];
    outbox.write(Writer::Wal, &first, true).await.unwrap();
    let lost = [event("c", 1)];
    outbox.write(Writer::Wal, &lost, false).await.unwrap();

    let relay = RelayProcess::start(&config.path);
    // Written while it runs: pushed by the stream, no polling.
    let later = [event("b", 2), event("a", 3)];
    let mut conn = outbox.pool.acquire().await.unwrap();
    let wal = WalOutbox::new(&outbox.tables);
    wal.enqueue_many(&mut conn, &later).await.unwrap();
    drop(conn);

    let (publisher, consumer) = stream_consumer(&stream, "waltest").await;
    let mut received: Vec<(String, Uuid)> = Vec::new();
    receive(&consumer, 5, Duration::from_secs(30), |message| {
        received.push((message.metadata.aggregate_id.clone(), message.id()));
        received.len()
    })
    .await;
    assert!(
        !received.iter().any(|(_, id)| *id == lost[0].id),
        "a rolled-back event was published"
    );
    let written: Vec<NewEvent> = first.iter().chain(&later).cloned().collect();
    assert_delivered(&received, &runs_of(&written));

    // `check` sees the slot; `stats` reports how much WAL its reader has not
    // acknowledged.
    let checked = run_ok(&config.path, &["check"]);
    assert!(
        checked.contains(&format!(
            "wal       ok: wal_level = logical, slot {slot_name} exists"
        )),
        "{checked}"
    );
    let stats = run_ok(&config.path, &["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_str(stats.trim()).unwrap();
    assert_eq!(stats["wal_slot"], slot_name.as_str());
    assert!(
        stats["wal_slot_lag_bytes"]
            .as_i64()
            .is_some_and(|lag| lag >= 0),
        "{stats}"
    );
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    publisher.jetstream().delete_stream(&stream).await.unwrap();
    outbox.drop_schema().await.unwrap();
}

/// Events emitted from SQL with `<events>_emit` (migration 8), as a producer in
/// another language writes them: the binary publishes the committed ones to NATS,
/// in commit order per aggregate, never one whose transaction rolled back nor a
/// refused one; an event emitted from SQL arrives as the same event written with
/// `WalOutbox` does (type, aggregate, headers, payload bytes).
#[tokio::test(flavor = "multi_thread")]
async fn the_binary_publishes_what_the_sql_emit_function_wrote_and_nothing_rolled_back() {
    let outbox = TestOutbox::new().await.unwrap();
    let WalToNats {
        config,
        stream,
        _cleanup,
        ..
    } = wal_to_nats(&outbox, "walsql");
    run_ok(&config.path, &["migrate"]);
    let emit = format!(
        "SELECT {}($1, $2, 'order.paid', $3, $4::jsonb)",
        outbox.tables.emit_function()
    );
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let headers = format!(r#"{{"traceparent": "{traceparent}"}}"#);
    let payload = r#"{"total": 10, "note": "caf\u00e9"}"#;
    let sql_event =
        async |tx: &mut sqlx::PgConnection, aggregate: &str| -> Result<Uuid, sqlx::Error> {
            sqlx::query_scalar(&emit)
                .bind("order")
                .bind(aggregate)
                .bind(payload)
                .bind(&headers)
                .fetch_one(tx)
                .await
        };
    let mut tx = outbox.pool.begin().await.unwrap();
    let a1 = sql_event(&mut tx, "a").await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = outbox.pool.begin().await.unwrap();
    let lost = sql_event(&mut tx, "c").await.unwrap();
    tx.rollback().await.unwrap();
    let mut tx = outbox.pool.begin().await.unwrap();
    let refused = sql_event(&mut tx, "").await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("event field `aggregate_id` is empty"),
        "{refused}"
    );
    tx.rollback().await.unwrap();
    let mut rust = NewEvent::from_json_str("order", "b", "order.paid", payload);
    rust.headers
        .insert("traceparent".into(), traceparent.into());
    outbox
        .write(Writer::Wal, std::slice::from_ref(&rust), true)
        .await
        .unwrap();
    let mut tx = outbox.pool.begin().await.unwrap();
    let b2 = sql_event(&mut tx, "b").await.unwrap();
    let a2 = sql_event(&mut tx, "a").await.unwrap();
    tx.commit().await.unwrap();

    let relay = RelayProcess::start(&config.path);
    let (publisher, consumer) = stream_consumer(&stream, "walsqltest").await;
    let mut received = Vec::new();
    receive(&consumer, 4, Duration::from_secs(30), |message| {
        received.push(message);
        received.len()
    })
    .await;
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    let late = consumer
        .fetch(10, Duration::from_millis(500))
        .await
        .unwrap();
    assert!(
        late.is_empty(),
        "more than the four committed events arrived"
    );
    let ids: Vec<Uuid> = received.iter().map(|m| m.id()).collect();
    assert!(!ids.contains(&lost), "a rolled-back event was published");
    let written = [(a1, "a"), (rust.id, "b"), (b2, "b"), (a2, "a")];
    let runs = written.iter().fold(
        std::collections::HashMap::new(),
        |mut runs, (id, aggregate)| {
            runs.entry(aggregate.to_string())
                .or_insert_with(Vec::new)
                .push(*id);
            runs
        },
    );
    let arrived: Vec<(String, Uuid)> = received
        .iter()
        .map(|m| (m.metadata.aggregate_id.clone(), m.id()))
        .collect();
    assert_delivered(&arrived, &runs);
    let by_id = |id: Uuid| received.iter().find(|m| m.id() == id).unwrap();
    let (from_rust, from_sql) = (by_id(rust.id), by_id(b2));
    for message in [from_rust, from_sql] {
        assert_eq!(message.payload().unwrap(), payload.as_bytes());
        assert_eq!(message.metadata.event_type, "order.paid");
        assert_eq!(message.metadata.aggregate_type, "order");
        assert_eq!(
            message
                .metadata
                .headers
                .get("traceparent")
                .map(String::as_str),
            Some(traceparent)
        );
    }
    assert_eq!(from_rust.metadata.headers, from_sql.metadata.headers);
    publisher.jetstream().delete_stream(&stream).await.unwrap();
    outbox.drop_schema().await.unwrap();
}
