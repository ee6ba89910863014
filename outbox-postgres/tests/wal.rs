//! The WAL outbox against the real PostgreSQL (`wal_level = logical`, which
//! scripts/test.sh sets): events enqueued as transactional logical messages are
//! read from a replication slot only when their transaction commits, in commit
//! order, and an acknowledged transaction is not read again after a reconnect.
#![cfg(feature = "wal")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::time::{Duration, Instant};

use pgoutbox_core::NewEvent;
use pgoutbox_postgres::testing::{
    drop_slot_when_released, TestDatabase, TestOutbox, TestSlot, Writer,
};
use pgoutbox_postgres::wal::{slot, WalEvent, WalOutbox, WalStream};
use pgoutbox_postgres::{Error, Ident};
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
    let wal = outbox.wal().await.unwrap();
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
    outbox
        .wal()
        .await
        .unwrap()
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
    let wal = outbox.wal().await.unwrap();
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

/// The SQL emit function refuses to write where nothing would read what it
/// writes, as `WalOutbox` does: before the WAL outbox is set up in the database,
/// and once its slot is gone (SQLSTATE 55000, naming why); it writes while the slot
/// can carry this database's events.
#[tokio::test(flavor = "multi_thread")]
async fn the_sql_emit_function_refuses_to_write_without_a_slot_of_this_database() {
    let outbox = TestOutbox::new().await.unwrap();
    let refused = |error: sqlx::Error, needle: &str| {
        let db = error.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("55000"), "{}", db.message());
        assert!(
            db.message()
                .starts_with("pgoutbox: WAL outbox write refused: ")
                && db.message().contains(needle),
            "{needle:?} not in {:?}",
            db.message()
        );
    };
    let mut conn = outbox.pool.acquire().await.unwrap();
    let before = emit_sql(&outbox, &mut conn, &event("a", 1)).await;
    refused(
        before.unwrap_err(),
        "the WAL outbox is not set up in this database",
    );
    drop(conn);

    let test_slot = TestSlot::create(&outbox).await;
    let mut conn = outbox.pool.acquire().await.unwrap();
    emit_sql(&outbox, &mut conn, &event("a", 2)).await.unwrap();

    slot::drop(&outbox.pool, &test_slot.slot, &test_slot.publication)
        .await
        .unwrap();
    let after = emit_sql(&outbox, &mut conn, &event("a", 3)).await;
    refused(
        after.unwrap_err(),
        &format!("no replication slot {} exists", test_slot.slot),
    );
    drop(conn);
    outbox.drop_schema().await.unwrap();
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
/// with `with_wal` (nothing in the table) and to the table without it; a WAL
/// outbox of other tables is refused.
#[tokio::test(flavor = "multi_thread")]
async fn with_wal_switches_the_same_outbox_calls_to_the_wal() {
    use pgoutbox_postgres::Outbox;

    let (outbox, _slot, wal_outbox, mut stream) = reading_a_fresh_slot().await;
    let other = pgoutbox_postgres::Tables::in_schema("elsewhere").unwrap();
    let err = Outbox::new(other).with_wal(wal_outbox.clone()).unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig(ref m) if m.contains("same tables")),
        "{err}"
    );
    for wal in [true, false] {
        let writer = Outbox::new(outbox.tables.clone());
        let writer = if wal {
            writer.with_wal(wal_outbox.clone()).unwrap()
        } else {
            writer
        };
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
    let wal = outbox.wal().await.unwrap();
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

/// A slot name of its own for a test (`outbox_test_wal_<random>`), and a guard
/// that drops the slot at the end of the test, also when it fails.
fn test_slot_name() -> (Ident, DropSlot) {
    let id = &Uuid::new_v4().simple().to_string()[..12];
    let name = Ident::new("slot", &format!("outbox_test_wal_{id}")).unwrap();
    (name.clone(), DropSlot(name))
}

/// A slot of its own (see [`test_slot_name`]) made on `conn` by `create`, an SQL
/// call taking the name as `$1`.
async fn slot_made_by(conn: &mut sqlx::PgConnection, create: &str) -> (Ident, DropSlot) {
    let (name, cleanup) = test_slot_name();
    sqlx::query(&format!("SELECT {create}"))
        .bind(name.as_str())
        .execute(conn)
        .await
        .unwrap();
    (name, cleanup)
}

struct DropSlot(Ident);

impl Drop for DropSlot {
    fn drop(&mut self) {
        // No publication of its own: a name that exists nowhere.
        let none = Ident::new("publication", "outbox_test_no_publication").unwrap();
        drop_slot_when_released(self.0.clone(), none);
    }
}

/// Rows of `table` (`schema.table`) on `pool`.
async fn count(pool: &sqlx::PgPool, table: &str) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    rows(&mut conn, table).await
}

/// Two transactions on `pool`, each inserting a row into a business table of
/// `schema` and then writing with `wal`, one with `enqueue_many`, one with
/// `commit`: both writes are refused with a reason containing `expected`, and
/// since each refused statement aborted its transaction, neither business row is
/// committed.
async fn assert_writes_refused(
    pool: &sqlx::PgPool,
    schema: &Ident,
    wal: &WalOutbox,
    expected: &str,
) {
    let business = format!("{schema}.business");
    sqlx::query(&format!("CREATE TABLE {business} (n int)"))
        .execute(pool)
        .await
        .unwrap();
    let insert = format!("INSERT INTO {business} VALUES (1)");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    let reason = refusal(
        wal.enqueue_many(&mut tx, &[event("a", 2), event("b", 1)])
            .await,
    );
    assert!(reason.contains(expected), "{reason}");
    // Its COMMIT rolls back.
    let _ = tx.commit().await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    let reason = refusal(wal.commit(tx, &[event("a", 3)]).await);
    assert!(reason.contains(expected), "{reason}");
    assert_eq!(count(pool, &business).await, 0, "a refused write committed");
}

/// `Error::WalSlot`'s reason, or a panic naming what came instead.
fn refusal<T: std::fmt::Debug>(result: Result<T, Error>) -> String {
    match result {
        Err(Error::WalSlot { reason, .. }) => reason,
        other => panic!("expected a slot refusal, got {other:?}"),
    }
}

/// A slot belongs to the server but decodes only the WAL of its own database.
/// Two databases of one server with the same outbox (schema and table) get
/// different default slot names. A slot of one database, under the name a
/// producer of the other would use, is refused when the slot is created (naming
/// its database; nothing created), when a WAL outbox is connected, and at every
/// write of a WAL outbox on a connection to the other database: the write fails
/// its statement, so the business row of its transaction is not committed
/// either, with `enqueue` as with `commit`.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_of_another_database_is_refused_and_nothing_commits() {
    let outbox = TestOutbox::new().await.unwrap();
    let slot = TestSlot::create(&outbox).await;
    let here: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&outbox.pool)
        .await
        .unwrap();
    let other = TestDatabase::create().await;
    pgoutbox_postgres::migrate(&other.pool, &outbox.tables)
        .await
        .unwrap();
    let mut conn = other.pool.acquire().await.unwrap();
    let others_slot = slot::resolve(&mut conn, &outbox.tables, None)
        .await
        .unwrap();
    drop(conn);
    assert_ne!(others_slot, slot.slot, "one default name for two databases");

    // Creating this database's slot for the other one: refused, nothing created.
    let publication = Ident::new("publication", "outbox_test_other_db").unwrap();
    let reason = refusal(slot::create(&other.pool, &slot.slot, &publication).await);
    let owner = format!("belongs to database {here}, not to {}", other.name);
    assert!(reason.contains(&owner), "{reason}");
    let published: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication.as_str())
            .fetch_one(&other.pool)
            .await
            .unwrap();
    assert!(!published, "a refused create made the publication");

    // A producer of the other database: refused when connected, for that slot
    // or for its own default (which does not exist).
    let reason = refusal(
        WalOutbox::connect_to_slot(
            &mut other.pool.acquire().await.unwrap(),
            &outbox.tables,
            &slot.slot,
        )
        .await,
    );
    assert!(reason.contains(&owner), "{reason}");
    let reason =
        refusal(WalOutbox::connect(&mut other.pool.acquire().await.unwrap(), &outbox.tables).await);
    assert!(
        reason.contains(&format!("no replication slot {others_slot} exists")),
        "{reason}"
    );

    // This database's WAL outbox writing on the other database's connections:
    // each write refused in its statement; the transactions commit nothing.
    let wal = outbox.wal().await.unwrap();
    assert_writes_refused(&other.pool, outbox.tables.schema(), &wal, &owner).await;

    outbox.drop_schema().await.unwrap();
}

/// A WAL outbox checks its slot at every write, not only when connected: once
/// its slot is dropped, `enqueue` and `commit` fail, the business rows of their
/// transactions are not committed, and no slot of the database reads anything
/// of them (a reader of another slot reads the next write after them first).
#[tokio::test(flavor = "multi_thread")]
async fn a_write_for_a_dropped_slot_fails_and_reaches_no_slot() {
    let (outbox, reader, _, mut stream) = reading_a_fresh_slot().await;
    let (name, _cleanup) = test_slot_name();
    slot::create(&outbox.pool, &name, &reader.publication)
        .await
        .unwrap();
    let wal = outbox.wal_to_slot(&name).await.unwrap();
    assert_eq!(wal.slot(), &name);
    let written = event("a", 1);
    let tx = outbox.pool.begin().await.unwrap();
    wal.commit(tx, std::slice::from_ref(&written))
        .await
        .unwrap();
    let (read, _) = next_transaction(&mut stream).await;
    assert_eq!(ids(&read), [written.id]);

    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(name.as_str())
        .execute(&outbox.pool)
        .await
        .unwrap();
    let missing = format!("no replication slot {name} exists");
    assert_writes_refused(&outbox.pool, outbox.tables.schema(), &wal, &missing).await;
    let mut conn = outbox.pool.acquire().await.unwrap();
    let reason = refusal(wal.verify(&mut conn).await);
    assert!(reason.contains(&missing), "{reason}");
    drop(conn);

    assert_next_read_is_a_new_marker(&outbox, &mut stream).await;
    close(stream, &outbox).await;
}

/// Slots that exist under the name but cannot carry the outbox are refused with
/// what was found: one still being created (it would not decode a transaction
/// that commits before its consistent point), one of another output plugin, a
/// temporary one and a physical one. The one being created is accepted once it is
/// complete.
#[tokio::test(flavor = "multi_thread")]
async fn slots_that_cannot_carry_the_outbox_are_refused_with_what_was_found() {
    use sqlx::Connection;

    let outbox = TestOutbox::new().await.unwrap();
    let connect = |name: Ident| {
        let outbox = outbox.clone();
        async move { outbox.wal_to_slot(&name).await }
    };

    // Being created: the server waits for a transaction that holds an id.
    let (creating, _cleanup) = test_slot_name();
    let mut holder = outbox.pool.begin().await.unwrap();
    let _: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let creation = tokio::spawn({
        let (pool, name) = (outbox.pool.clone(), creating.clone());
        async move {
            sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                .bind(name.as_str())
                .execute(&pool)
                .await
        }
    });
    let deadline = Instant::now() + WAIT;
    while !slot::exists(&outbox.pool, &creating).await.unwrap() {
        assert!(
            Instant::now() < deadline,
            "the slot's creation did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reason = refusal(connect(creating.clone()).await);
    assert!(reason.contains("is still being created"), "{reason}");
    holder.commit().await.unwrap();
    creation.await.unwrap().unwrap();
    connect(creating.clone()).await.unwrap();

    // Another output plugin: also refused by create.
    let mut conn = outbox.pool.acquire().await.unwrap();
    let (decoding, _cleanup) = slot_made_by(
        &mut conn,
        "pg_create_logical_replication_slot($1, 'test_decoding')",
    )
    .await;
    let reason = refusal(connect(decoding.clone()).await);
    assert!(
        reason.contains("uses the output plugin test_decoding"),
        "{reason}"
    );
    let publication = Ident::new("publication", "outbox_test_never_made").unwrap();
    let reason = refusal(slot::create(&outbox.pool, &decoding, &publication).await);
    assert!(reason.contains("test_decoding"), "{reason}");

    // Physical (reserving no WAL).
    let (physical, _cleanup) =
        slot_made_by(&mut conn, "pg_create_physical_replication_slot($1)").await;
    let reason = refusal(connect(physical.clone()).await);
    assert!(reason.contains("is a physical slot"), "{reason}");
    drop(conn);

    // Temporary: it lives as long as the session that made it.
    let mut session = sqlx::PgConnection::connect(&pgoutbox_postgres::testing::database_url())
        .await
        .unwrap();
    let (temporary, _cleanup) = slot_made_by(
        &mut session,
        "pg_create_logical_replication_slot($1, 'pgoutput', true)",
    )
    .await;
    let reason = refusal(connect(temporary.clone()).await);
    assert!(reason.contains("is temporary"), "{reason}");
    session.close().await.unwrap();

    outbox.drop_schema().await.unwrap();
}

/// The hash ending a default slot name is PostgreSQL's `sha256()` of
/// `<schema>.<table>@<database>` (as `wal::slot::default_name` documents), so SQL
/// can name the slot too: checked for this database and for a name that needs
/// replacing and cutting.
#[tokio::test(flavor = "multi_thread")]
async fn the_default_slot_names_hash_is_the_servers_sha256() {
    let outbox = TestOutbox::new().await.unwrap();
    let here: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&outbox.pool)
        .await
        .unwrap();
    for database in [
        here.as_str(),
        "Shop-EU \u{fc}n\u{ef}code with a long name, cut",
    ] {
        let hash: String = sqlx::query_scalar(
            "SELECT left(encode(sha256(convert_to($1 || '@' || $2, 'UTF8')), 'hex'), 12)",
        )
        .bind(outbox.tables.outbox_name())
        .bind(database)
        .fetch_one(&outbox.pool)
        .await
        .unwrap();
        let name = slot::default_name(database, &outbox.tables).unwrap();
        assert!(
            name.as_str().ends_with(&format!("_{hash}")),
            "{name} for {database}"
        );
        assert!(name.as_str().len() <= 63);
    }
    outbox.drop_schema().await.unwrap();
}
