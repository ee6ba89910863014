//! The WAL outbox against the real PostgreSQL (`wal_level = logical`, which
//! scripts/test.sh sets): events enqueued as transactional logical messages are
//! read from a replication slot only when their transaction commits, in commit
//! order, and an acknowledged transaction is not read again after a reconnect.
#![cfg(feature = "wal")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::time::{Duration, Instant};

use pgoutbox_core::NewEvent;
use pgoutbox_postgres::testing::{TestOutbox, TestSlot, Writer};
use pgoutbox_postgres::wal::{WalEvent, WalOutbox, WalStream};
use pgoutbox_postgres::Error;
use uuid::Uuid;

/// Longest wait for what a test expects from the stream.
const WAIT: Duration = Duration::from_secs(30);

fn event(aggregate: &str, n: u32) -> NewEvent {
    NewEvent::new(
        "order",
        aggregate,
        "order.created",
        &serde_json::json!({ "aggregate": aggregate, "n": n }),
    )
}

/// The next transaction of the stream, skipping idle reports, within `WAIT`.
async fn next_transaction(stream: &mut WalStream) -> (Vec<pgoutbox_core::Event>, u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let item = tokio::time::timeout(left, stream.next())
            .await
            .expect("a transaction within 30 s")
            .unwrap()
            .expect("the stream goes on");
        if let WalEvent::Transaction { events, end_lsn } = item {
            return (events, end_lsn);
        }
    }
}

/// The slot's confirmed position, as a byte offset (`None`: no position yet).
async fn confirmed_lsn(outbox: &TestOutbox, slot: &TestSlot) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::bigint \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot.slot.as_str())
    .fetch_one(&outbox.pool)
    .await
    .unwrap()
}

/// Wait until the slot's confirmed position is at `lsn` or past it (at most
/// `limit`), doing `meanwhile` between looks.
async fn wait_until_confirmed(
    outbox: &TestOutbox,
    slot: &TestSlot,
    lsn: i64,
    limit: Duration,
    mut meanwhile: impl AsyncFnMut(),
) {
    let deadline = Instant::now() + limit;
    loop {
        let confirmed = confirmed_lsn(outbox, slot).await;
        if confirmed.is_some_and(|confirmed| confirmed >= lsn) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the slot stays at {confirmed:?}, short of {lsn}, after {limit:?}"
        );
        meanwhile().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fresh outbox, a slot of its own, a WAL writer for the outbox and a reader of
/// the slot.
async fn reading_a_fresh_slot() -> (TestOutbox, TestSlot, WalOutbox, WalStream) {
    let outbox = TestOutbox::new().await.unwrap();
    let slot = TestSlot::create(&outbox).await;
    let wal = WalOutbox::new(&outbox.tables);
    let stream = slot.stream(&wal).await;
    (outbox, slot, wal, stream)
}

/// Close the reader and drop the outbox.
async fn close(stream: WalStream, outbox: &TestOutbox) {
    stream.close().await.unwrap();
    outbox.drop_schema().await.unwrap();
}

fn ids(events: &[pgoutbox_core::Event]) -> Vec<Uuid> {
    events.iter().map(|e| e.id).collect()
}

/// Commit a marker event to the WAL in a transaction of its own and check that it
/// is the next transaction `stream` reads: nothing else reached the WAL since the
/// stream's last read.
async fn assert_next_read_is_a_new_marker(outbox: &TestOutbox, stream: &mut WalStream) {
    let marker = event("z", 1);
    let tx = outbox.pool.begin().await.unwrap();
    WalOutbox::new(&outbox.tables)
        .commit(tx, std::slice::from_ref(&marker))
        .await
        .unwrap();
    let (read, _) = next_transaction(stream).await;
    assert_eq!(ids(&read), [marker.id], "another transaction came first");
}

#[tokio::test(flavor = "multi_thread")]
async fn only_committed_events_are_read_in_commit_order() {
    let (outbox, _slot, wal, mut stream) = reading_a_fresh_slot().await;

    // Committed: two events of one aggregate.
    let first = [event("a", 1), event("a", 2)];
    outbox.write(Writer::Wal, &first, true).await.unwrap();
    // Rolled back: never read.
    let lost = [event("b", 1)];
    outbox.write(Writer::Wal, &lost, false).await.unwrap();
    // Two transactions open at once: the one that commits first is read first,
    // whatever the order of their writes.
    let (early, late) = (event("c", 1), event("a", 3));
    let mut written_first = outbox.pool.begin().await.unwrap();
    wal.enqueue(&mut written_first, &late).await.unwrap();
    let mut written_second = outbox.pool.begin().await.unwrap();
    wal.enqueue(&mut written_second, &early).await.unwrap();
    written_second.commit().await.unwrap();
    written_first.commit().await.unwrap();

    let (events, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&events), ids_of(&first));
    assert_eq!(events[1].payload.get(), r#"{"aggregate":"a","n":2}"#);
    assert_eq!((events[0].seq, events[1].seq), (1, 2));
    assert_eq!(events[0].aggregate_id, "a");
    let (events, _) = next_transaction(&mut stream).await;
    assert_eq!(
        ids(&events),
        [early.id],
        "the rolled-back event came through"
    );
    let (events, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&events), [late.id]);

    close(stream, &outbox).await;
}

fn ids_of(events: &[NewEvent]) -> Vec<Uuid> {
    events.iter().map(|e| e.id).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_acknowledged_transaction_is_not_read_again_the_rest_is() {
    let outbox = TestOutbox::new().await.unwrap();
    let slot = TestSlot::create(&outbox).await;
    let wal = WalOutbox::new(&outbox.tables);
    let (one, two) = (event("a", 1), event("a", 2));
    for e in [&one, &two] {
        let mut conn = outbox.pool.acquire().await.unwrap();
        wal.enqueue(&mut conn, e).await.unwrap();
    }

    let mut stream = slot.stream(&wal).await;
    let (events, end_lsn) = next_transaction(&mut stream).await;
    assert_eq!(ids(&events), [one.id]);
    stream.ack(end_lsn);
    // Read the second but do not acknowledge it (as if the broker had not
    // confirmed it when the relay died).
    let (events, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&events), [two.id]);
    // The server confirms what was acknowledged.
    let end_lsn = i64::try_from(end_lsn).unwrap();
    wait_until_confirmed(&outbox, &slot, end_lsn, WAIT, async || {}).await;
    stream.close().await.unwrap();

    // A new reader (the relay restarted) starts after the acknowledged one.
    let mut stream = slot.stream(&wal).await;
    let (events, _) = next_transaction(&mut stream).await;
    assert_eq!(
        ids(&events),
        [two.id],
        "at least once: the unacknowledged one again"
    );
    close(stream, &outbox).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_events_are_refused_and_nothing_is_written() {
    let (outbox, _slot, wal, mut stream) = reading_a_fresh_slot().await;

    let mut delayed = event("a", 1);
    delayed.not_before = Some(chrono::Utc::now() + chrono::Duration::minutes(5));
    let mut invalid = event("a", 2);
    invalid.payload = "{not json".into();
    let mut conn = outbox.pool.acquire().await.unwrap();
    let err = wal
        .enqueue_many(&mut conn, &[event("a", 0), delayed])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Wal(ref m) if m.contains("not_before")),
        "{err}"
    );
    let err = wal.enqueue(&mut conn, &invalid).await.unwrap_err();
    assert!(matches!(err, Error::InvalidEvent(_)), "{err}");
    // Nothing of the refused calls reached the WAL: the next transaction read is this one.
    let marker = event("z", 1);
    wal.enqueue(&mut conn, &marker).await.unwrap();
    let (events, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&events), [marker.id]);

    close(stream, &outbox).await;
}

async fn rows(conn: &mut sqlx::PgConnection, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(conn)
        .await
        .unwrap()
}

/// `WalOutbox::commit` writes the events and commits in one round trip: the
/// business row and the events exist together, contents survive the literal
/// quoting byte for byte, the connection is left outside any transaction, and a
/// refused call writes nothing and rolls the business row back.
#[tokio::test(flavor = "multi_thread")]
async fn commit_writes_the_events_with_the_transaction_or_nothing() {
    use sqlx::Connection;

    let (outbox, _slot, wal, mut stream) = reading_a_fresh_slot().await;
    let business = format!("{}.commit_test", outbox.tables.schema());
    sqlx::query(&format!("CREATE TABLE {business} (n int)"))
        .execute(&outbox.pool)
        .await
        .unwrap();
    let insert = format!("INSERT INTO {business} VALUES (1)");
    let mut conn = sqlx::PgConnection::connect(&pgoutbox_postgres::testing::database_url())
        .await
        .unwrap();

    // Quotes, backslashes, a dollar-quote lookalike and non-ASCII text.
    let tricky = NewEvent::new(
        "order",
        "a'b",
        "order.created",
        &serde_json::json!({ "note": "it's a \\ back\\slash, $$ and \"quotes\", \u{e9}t\u{e9} \u{1f4e6}" }),
    );
    let events = [tricky.clone(), event("a'b", 2)];
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    assert_eq!(wal.commit(tx, &events).await.unwrap(), ids_of(&events));
    let (read, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&read), ids_of(&events));
    assert_eq!(read[0].payload.get(), tricky.payload);
    assert_eq!(read[0].aggregate_id, "a'b");
    assert_eq!(
        rows(&mut conn, &business).await,
        1,
        "the business row is committed"
    );
    // Outside a transaction each statement gets its own transaction id.
    let mut xids = Vec::new();
    for _ in 0..2 {
        let xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        xids.push(xid);
    }
    let outside = xids[0] != xids[1];
    assert!(outside, "the connection was left inside a transaction");

    // The connection's next transaction is a real one (not a savepoint of a
    // leftover): rolled back, its row is gone.
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(rows(&mut conn, &business).await, 1);

    // A refused event: nothing written, the business row rolled back.
    let mut invalid = event("a", 3);
    invalid.payload = "{not json".into();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    let err = wal.commit(tx, &[event("a", 2), invalid]).await.unwrap_err();
    assert!(matches!(err, Error::InvalidEvent(_)), "{err}");
    assert_eq!(
        rows(&mut conn, &business).await,
        1,
        "the refused call's row was committed"
    );

    // A savepoint cannot be committed this way: refused, nothing written.
    let mut outer = conn.begin().await.unwrap();
    let inner = outer.begin().await.unwrap();
    let err = wal.commit(inner, &[event("a", 4)]).await.unwrap_err();
    assert!(
        matches!(err, Error::Wal(ref m) if m.contains("outermost")),
        "{err}"
    );
    outer.rollback().await.unwrap();

    // Nothing of the refused calls reached the WAL.
    assert_next_read_is_a_new_marker(&outbox, &mut stream).await;

    conn.close().await.unwrap();
    close(stream, &outbox).await;
}

/// Emit `event` with the SQL function of migration 8 (`<events>_emit`) on `conn`,
/// as a producer without the Rust crate would; the id is the event's own.
async fn emit_sql(
    outbox: &TestOutbox,
    conn: &mut sqlx::PgConnection,
    event: &NewEvent,
) -> Result<Uuid, sqlx::Error> {
    let headers = serde_json::to_value(&event.headers).unwrap();
    sqlx::query_scalar(&format!(
        "SELECT {}($1, $2, $3, $4, $5, $6, $7)",
        outbox.tables.emit_function()
    ))
    .bind(&event.aggregate_type)
    .bind(&event.aggregate_id)
    .bind(&event.event_type)
    .bind(&event.payload)
    .bind(headers)
    .bind(&event.destination)
    .bind(event.id)
    .fetch_one(conn)
    .await
}

/// The message contents of the next transactions written to the WAL under `prefix`,
/// as a logical decoding plugin receives them (`test_decoding`, a temporary slot
/// created before they were written).
async fn raw_messages(conn: &mut sqlx::PgConnection, slot: &str, prefix: &str) -> Vec<String> {
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL) WHERE data LIKE 'message:%'",
    )
    .bind(slot)
    .fetch_all(conn)
    .await
    .unwrap();
    // "message: transactional: 1 prefix: P, sz: N content:C"
    rows.into_iter()
        .filter(|row| row.contains(&format!("prefix: {prefix},")))
        .map(|row| row.split_once(" content:").unwrap().1.to_owned())
        .collect()
}

/// A message's text with its id and creation time blanked, for comparing two
/// emissions of one event.
fn blank_id_and_time(content: &str, id: Uuid) -> String {
    let content = content.replace(&id.to_string(), "ID");
    let (head, time) = content.split_once(r#""created_at":""#).unwrap();
    assert!(time.ends_with(r#"Z"}"#), "{time}");
    let digits = time
        .trim_end_matches(r#"Z"}"#)
        .split_once('.')
        .map(|(_, f)| f.len());
    assert!(matches!(digits, None | Some(3 | 6 | 9)), "{time}");
    format!("{head}\"created_at\":TIME}}")
}

/// The SQL emit function writes what `WalOutbox` writes: the same event emitted
/// both ways gives byte-identical message contents (but for id and time) and the
/// same event to the relay's reader, headers, destination and payload included.
#[tokio::test(flavor = "multi_thread")]
async fn the_sql_emit_function_writes_what_wal_outbox_writes() {
    let (outbox, _slot, wal, mut stream) = reading_a_fresh_slot().await;
    let mut raw = outbox.pool.acquire().await.unwrap();
    let decoding = format!(
        "outbox_test_decoding_{}",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'test_decoding', true)")
        .bind(&decoding)
        .execute(&mut *raw)
        .await
        .unwrap();

    // Quotes, backslashes, control characters, non-ASCII text and spaces in the
    // payload (kept verbatim), headers out of order, a destination.
    let payload =
        " { \"note\" : \"it's a \\\\ \\\"q\\\" \\n \u{e9}t\u{e9} \u{1f4e6}\", \"n\": [1, 2.50] } ";
    let mut rust = NewEvent::from_json_str("order\t\"x\"", "a'b \u{e9}", "order.created", payload);
    rust.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    rust.headers.insert("Z-last".into(), "z".into());
    rust.headers
        .insert("a\u{e9}".into(), "line\nbreak \u{1}".into());
    rust.destination = Some("orders.special".into());
    let mut sql = rust.clone();
    sql.id = Uuid::new_v4();

    let mut tx = outbox.pool.begin().await.unwrap();
    wal.enqueue(&mut tx, &rust).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = outbox.pool.begin().await.unwrap();
    assert_eq!(emit_sql(&outbox, &mut tx, &sql).await.unwrap(), sql.id);
    tx.commit().await.unwrap();

    let (from_rust, _) = next_transaction(&mut stream).await;
    let (from_sql, _) = next_transaction(&mut stream).await;
    let (a, b) = (&from_rust[0], &from_sql[0]);
    assert_eq!((a.id, b.id), (rust.id, sql.id));
    // Verbatim, but for the spaces around it, which no JSON reader keeps.
    assert_eq!(b.payload.get(), payload.trim(), "the payload verbatim");
    assert_eq!(
        (
            &a.aggregate_type,
            &a.aggregate_id,
            &a.event_type,
            a.payload.get(),
            &a.headers,
            &a.destination
        ),
        (
            &b.aggregate_type,
            &b.aggregate_id,
            &b.event_type,
            b.payload.get(),
            &b.headers,
            &b.destination
        ),
    );
    let age = chrono::Utc::now() - b.created_at;
    assert!(
        age >= chrono::Duration::zero() && age < chrono::Duration::minutes(1),
        "{age}"
    );

    let prefix = wal.prefix().to_owned();
    let contents = raw_messages(&mut raw, &decoding, &prefix).await;
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&decoding)
        .execute(&mut *raw)
        .await
        .unwrap();
    assert_eq!(contents.len(), 2, "{contents:?}");
    assert_eq!(
        blank_id_and_time(&contents[1], sql.id),
        blank_id_and_time(&contents[0], rust.id),
    );
    drop(raw);
    close(stream, &outbox).await;
}

/// An event emitted from SQL in a transaction that rolls back is never read; bad
/// input is refused with an error naming what is wrong (SQLSTATE 22023), and
/// nothing is emitted.
#[tokio::test(flavor = "multi_thread")]
async fn the_sql_emit_function_refuses_bad_input_and_rolls_back_with_its_transaction() {
    let (outbox, _slot, _, mut stream) = reading_a_fresh_slot().await;

    let lost = event("a", 1);
    let mut tx = outbox.pool.begin().await.unwrap();
    emit_sql(&outbox, &mut tx, &lost).await.unwrap();
    tx.rollback().await.unwrap();

    let with = |f: &dyn Fn(&mut NewEvent)| {
        let mut e = event("a", 2);
        f(&mut e);
        e
    };
    let cases: Vec<(NewEvent, &str)> = vec![
        (
            with(&|e| e.aggregate_id = String::new()),
            "event field `aggregate_id` is empty",
        ),
        (
            with(&|e| e.aggregate_type = " \t ".into()),
            "event field `aggregate_type` is empty",
        ),
        (
            with(&|e| e.event_type = "x".repeat(1025)),
            "event field `event_type` is 1025 bytes long; the limit is 1024",
        ),
        (
            with(&|e| e.destination = Some(String::new())),
            "event field `destination` is empty",
        ),
        (
            with(&|e| e.payload = "{not json".into()),
            "is not valid JSON: invalid input syntax for type json",
        ),
        (
            with(&|e| e.payload = r#"{"a":"\u0000"}"#.into()),
            "contains \\u0000",
        ),
        (
            with(&|e| {
                e.headers.insert(String::new(), "x".into());
            }),
            "has a header with an empty name",
        ),
    ];
    let mut conn = outbox.pool.acquire().await.unwrap();
    for (bad, needle) in &cases {
        let err = emit_sql(&outbox, &mut conn, bad).await.unwrap_err();
        let db = err.as_database_error().expect("a database error");
        assert!(
            db.message().contains(needle),
            "{needle:?} not in {:?}",
            db.message()
        );
        assert_eq!(db.code().as_deref(), Some("22023"), "{}", db.message());
    }
    // Headers must be an object of strings: checked before anything is emitted.
    let bad_headers = format!(
        "SELECT {}('order', 'a', 'order.created', '{{}}', $1::jsonb)",
        outbox.tables.emit_function()
    );
    for (headers, needle) in [
        (r#"{"n": 1}"#, "header `n` of event"),
        ("[]", "are a JSON array, not an object of strings"),
    ] {
        let err = sqlx::query(&bad_headers)
            .bind(headers)
            .execute(&mut *conn)
            .await
            .unwrap_err();
        let message = err.as_database_error().unwrap().message().to_owned();
        assert!(message.contains(needle), "{message}");
    }
    // Defaults: no headers, no destination, a fresh id.
    let id: Uuid = sqlx::query_scalar(&format!(
        "SELECT {}('order', 'z', 'order.created', '{{\"n\":1}}')",
        outbox.tables.emit_function()
    ))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    drop(conn);

    // Nothing of the rolled-back or refused calls reached the WAL.
    let (read, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&read), [id]);
    assert!(read[0].headers.is_empty() && read[0].destination.is_none());
    assert_eq!(read[0].payload.get(), r#"{"n":1}"#);
    close(stream, &outbox).await;
}

/// One setting switches a producer: the same `Outbox` calls write to the WAL
/// with `with_wal(true)` (nothing in the table) and to the table without it.
#[tokio::test(flavor = "multi_thread")]
async fn with_wal_switches_the_same_outbox_calls_to_the_wal() {
    use pgoutbox_postgres::Outbox;

    let (outbox, _slot, _, mut stream) = reading_a_fresh_slot().await;
    for wal in [true, false] {
        let writer = Outbox::new(outbox.tables.clone()).with_wal(wal);
        assert_eq!(writer.is_wal(), wal);
        let (one, many, committed) = (event("a", 1), [event("a", 2), event("b", 1)], event("a", 3));
        let mut tx = outbox.pool.begin().await.unwrap();
        writer.enqueue(&mut tx, &one).await.unwrap();
        writer.enqueue_many(&mut tx, &many).await.unwrap();
        writer
            .commit(tx, std::slice::from_ref(&committed))
            .await
            .unwrap();
        let rows = common::remaining(&outbox).await;
        let written = [one.id, many[0].id, many[1].id, committed.id];
        if wal {
            assert_eq!(rows, 0, "WAL mode wrote to the table");
            let (read, _) = next_transaction(&mut stream).await;
            assert_eq!(ids(&read), written);
        } else {
            assert_eq!(rows, 4, "table mode did not write its rows");
        }
    }
    // Table mode wrote nothing to the WAL.
    assert_next_read_is_a_new_marker(&outbox, &mut stream).await;

    close(stream, &outbox).await;
}

/// The core relay over a [`WalStore`]: a failing event parks in the outbox table
/// with the events of its aggregate that follow it, while other aggregates flow;
/// once the failure clears, a table relay drains the parked ones, and every
/// aggregate's events arrive in commit order.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_event_parks_in_the_table_with_its_followers_others_flow() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use pgoutbox_core::testing::RecordingPublisher;
    use pgoutbox_core::{PublishError, Relay, RelayConfig, RetryPolicy, Store};
    use pgoutbox_postgres::wal::WalStore;

    let outbox = TestOutbox::new().await.unwrap();
    let slot = TestSlot::create(&outbox).await;
    let wal = WalOutbox::new(&outbox.tables);
    let (a1, a2, a3, b1, b2) = (
        event("a", 1),
        event("a", 2),
        event("a", 3),
        event("b", 1),
        event("b", 2),
    );
    let first = [a1.clone(), b1.clone(), a2.clone(), a3.clone(), b2.clone()];
    outbox.write(Writer::Wal, &first, true).await.unwrap();
    let (a4, b3) = (event("a", 4), event("b", 3));
    // Where the WAL is before the last transaction commits: once the slot's
    // confirmed position is past it, everything was acknowledged.
    let before_last: i64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
            .fetch_one(&outbox.pool)
            .await
            .unwrap();
    let mut conn = outbox.pool.acquire().await.unwrap();
    wal.enqueue_many(&mut conn, &[a4.clone(), b3.clone()])
        .await
        .unwrap();
    drop(conn);

    let failing = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&failing);
    let failing_id = a2.id;
    let publisher = Arc::new(RecordingPublisher::failing_when(move |e| {
        (e.id == failing_id && flag.load(Ordering::SeqCst))
            .then(|| PublishError::retryable("broker refused it, for now"))
    }));
    let config = RelayConfig::default()
        .batch_size(3)
        .retry(RetryPolicy::default().base_delay(Duration::from_millis(50)));
    let store = WalStore::new(outbox.pool.clone(), outbox.tables.clone(), slot.source());
    let relay = Relay::new(store, Arc::clone(&publisher)).with_config(config.clone());

    // The WAL relay publishes everything but aggregate a from a2 on.
    let flowing = [a1.id, b1.id, b2.id, b3.id];
    let deadline = Instant::now() + WAIT;
    while !flowing
        .iter()
        .all(|id| publisher.published_ids().contains(id))
    {
        assert!(
            Instant::now() < deadline,
            "published only {:?}",
            publisher.published_ids()
        );
        relay
            .store()
            .wait_for_events(Duration::from_millis(100))
            .await;
        relay.run_once().await.unwrap();
    }
    let parked: Vec<(Uuid, i32)> = sqlx::query_as(&format!(
        "SELECT id, attempts FROM {}.outbox_events WHERE processed_at IS NULL ORDER BY seq",
        outbox.tables.schema().quoted()
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap();
    assert_eq!(
        parked,
        [(a2.id, 1), (a3.id, 0), (a4.id, 0)],
        "parked in order behind the failure"
    );
    assert!(
        !publisher.published_ids().contains(&a3.id),
        "a follower overtook its failed event"
    );
    assert_eq!(
        relay.store().pending().await.unwrap(),
        0,
        "everything resolved"
    );

    // A relay that starts now (the first one died, say) knows nothing of the parked
    // events but what the table says: a later event of aggregate a waits too. (The
    // first relay's acknowledgements reached the server first: the new one reads
    // only what follows, not the failure again.)
    wait_until_confirmed(&outbox, &slot, before_last + 1, WAIT, async || {
        relay.run_once().await.unwrap();
    })
    .await;
    drop(relay);
    let a5 = event("a", 5);
    let mut conn = outbox.pool.acquire().await.unwrap();
    wal.enqueue(&mut conn, &a5).await.unwrap();
    drop(conn);
    let store = WalStore::new(outbox.pool.clone(), outbox.tables.clone(), slot.source());
    let relay = Relay::new(store, Arc::clone(&publisher)).with_config(config.clone());
    let deadline = Instant::now() + WAIT;
    loop {
        relay
            .store()
            .wait_for_events(Duration::from_millis(100))
            .await;
        relay.run_once().await.unwrap();
        let parked: Option<Uuid> = sqlx::query_scalar(&format!(
            "SELECT id FROM {}.outbox_events WHERE id = $1",
            outbox.tables.schema().quoted()
        ))
        .bind(a5.id)
        .fetch_optional(&outbox.pool)
        .await
        .unwrap();
        if parked.is_some() {
            break;
        }
        assert!(
            !publisher.published_ids().contains(&a5.id),
            "a5 overtook the parked a2"
        );
        assert!(Instant::now() < deadline, "a5 neither parked nor published");
    }

    // The failure clears: a table relay drains the parked events in order.
    failing.store(false, Ordering::SeqCst);
    let table = Relay::new(outbox.store(), Arc::clone(&publisher)).with_config(config);
    let deadline = Instant::now() + WAIT;
    while !publisher.published_ids().contains(&a5.id) {
        assert!(
            Instant::now() < deadline,
            "the parked events were not drained"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        table.run_once().await.unwrap();
    }
    // First arrivals: the second relay read again what the first had published
    // but not yet acknowledged to the slot (at least once), and parked those of
    // aggregate a behind a's parked events; consumers skip such repeats by id.
    let order = |aggregate: &str| -> Vec<Uuid> {
        let mut seen = std::collections::HashSet::new();
        publisher
            .published()
            .iter()
            .filter(|e| e.aggregate_id == aggregate && seen.insert(e.id))
            .map(|e| e.id)
            .collect()
    };
    assert_eq!(order("a"), [a1.id, a2.id, a3.id, a4.id, a5.id]);
    assert_eq!(order("b"), [b1.id, b2.id, b3.id]);

    drop(relay);
    outbox.drop_schema().await.unwrap();
}

/// An idle WAL relay acknowledges the server's position when it reports it (a
/// heartbeat): over 60 s in which other tables are written and the outbox is not,
/// with the default heartbeat (30 s), the slot follows the server's WAL instead
/// of keeping all of it.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_relay_lets_the_slot_follow_the_server_for_60_s() {
    use std::sync::Arc;

    use pgoutbox_core::testing::RecordingPublisher;
    use pgoutbox_core::Relay;
    use pgoutbox_postgres::wal::WalStore;

    const IDLE: Duration = Duration::from_secs(60);
    let outbox = TestOutbox::new().await.unwrap();
    let slot = TestSlot::create(&outbox).await;
    let source = slot.source();
    assert_eq!(source.heartbeat, Duration::from_secs(30), "the default");
    let heartbeat = source.heartbeat;
    let store = WalStore::new(outbox.pool.clone(), outbox.tables.clone(), source);
    let relay = Arc::new(Relay::new(store, RecordingPublisher::new()));
    let (stop, running) = common::spawn_until_stopped({
        let relay = Arc::clone(&relay);
        |stopped| async move { relay.run(stopped).await }
    });

    // Other work writes WAL every 2 s; the outbox writes nothing.
    let noise = format!("{}.noise", outbox.tables.schema().quoted());
    sqlx::query(&format!("CREATE TABLE {noise} (n int)"))
        .execute(&outbox.pool)
        .await
        .unwrap();
    let started = Instant::now();
    let mut written = Vec::new(); // (when, the server's WAL position after the write)
    while started.elapsed() < IDLE {
        sqlx::query(&format!(
            "INSERT INTO {noise} SELECT generate_series(1, 1000)"
        ))
        .execute(&outbox.pool)
        .await
        .unwrap();
        let lsn: i64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
                .fetch_one(&outbox.pool)
                .await
                .unwrap();
        written.push((started.elapsed(), lsn));
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Within a heartbeat (and a margin) of the idle period's end, the slot has
    // confirmed at least what was written a heartbeat before that end.
    let target = written
        .iter()
        .rev()
        .find(|(when, _)| *when + heartbeat <= IDLE)
        .map(|(_, lsn)| *lsn)
        .unwrap();
    // (The server was at `target` a heartbeat before the idle period ended.)
    let limit = heartbeat + Duration::from_secs(10);
    wait_until_confirmed(&outbox, &slot, target, limit, async || {}).await;
    let _ = stop.send(());
    running.await.unwrap();
    outbox.drop_schema().await.unwrap();
}
