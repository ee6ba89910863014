//! The `outbox` binary in WAL mode (`[wal] enabled`) against the real PostgreSQL
//! (`wal_level = logical`, set by scripts/test.sh) and NATS: `migrate` creates the
//! slot, the relay publishes what committed transactions wrote with `WalOutbox`,
//! in commit order per aggregate, never what rolled back, and `stats` shows the
//! slot's lag. Two databases of one server each get a slot of their own; a slot
//! of another database is refused by `migrate`, `check`, producers and the
//! relay's readiness; a slot made under the former default name keeps working.
#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{
    assert_delivered, command, default_publication, free_port, get, receive, run_ok, runs_of,
    sample, stream_consumer, wait_for, Config, DropSlot, RelayProcess,
};
use pgoutbox_core::testing::event;
use pgoutbox_core::NewEvent;
use pgoutbox_nats::{EventConsumer, NatsConfig};
use pgoutbox_postgres::testing::{database_url, TestDatabase, TestOutbox, Writer};
use pgoutbox_postgres::wal::{slot, WalOutbox};
use pgoutbox_postgres::{Error, Ident, Outbox, Tables};
use uuid::Uuid;

/// Longest wait for what a test expects from a relay process.
const WAIT: Duration = Duration::from_secs(60);

/// `outbox <args>` failing with the config exit code; its stderr.
fn refused(config: &std::path::Path, args: &[&str]) -> String {
    let out = command(config, args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(2),
        "outbox {args:?} did not fail as a config error: {}{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

#[tokio::test(flavor = "multi_thread")]
async fn the_binary_publishes_committed_wal_events_in_commit_order() {
    let outbox = TestOutbox::new().await.unwrap();
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    // The default slot (named after the outbox and the database), which the
    // producers look for too.
    let names = DropSlot::defaults(&outbox).await;
    let slot_name = names.slot.clone();
    let stream = format!("OUTBOX_WAL_TEST_{tag}");
    let prefix = format!("waltest{tag}");
    let config = Config::with_broker(
        outbox.tables.schema().as_str(),
        "0",
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nsubject_prefix = \"{prefix}\"\n\
             ensure_stream = \"{stream}\"\n[wal]\nenabled = true\n"
        ),
    );

    // Without its slot, `check` and producers say what to do.
    let missing = refused(&config.path, &["check"]);
    assert!(
        missing.contains(&format!("no replication slot {slot_name} exists"))
            && missing.contains("outbox migrate"),
        "{missing}"
    );
    assert!(matches!(outbox.wal().await, Err(Error::WalSlot { .. })));
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
    let wal = outbox.wal().await.unwrap();
    wal.enqueue_many(&mut conn, &later).await.unwrap();
    drop(conn);

    let publisher = NatsConfig::from_env().unwrap().connect().await.unwrap();
    // The relay makes the stream as it starts.
    let deadline = Instant::now() + Duration::from_secs(30);
    let consumer = loop {
        match EventConsumer::durable(publisher.jetstream(), &stream, "waltest", "").await {
            Ok(consumer) => break consumer,
            Err(e) if Instant::now() < deadline && e.to_string().contains("stream not found") => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no consumer on {stream}: {e}"),
        }
    };
    let mut received: Vec<(String, Uuid)> = Vec::new();
    while received.len() < 5 {
        assert!(Instant::now() < deadline, "received only {received:?}");
        for message in consumer
            .fetch(10, Duration::from_millis(500))
            .await
            .unwrap()
        {
            let message = message.unwrap();
            message.ack().await.unwrap();
            received.push((message.metadata.aggregate_id.clone(), message.id()));
        }
    }
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
            "wal       ok: wal_level = logical, slot {slot_name} can carry this database's events"
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
    drop(names);
}

/// A config of the WAL outbox in `schema` of the database at `url`, with the
/// stdout broker, HTTP on a free port and `wal` (the rest of the `[wal]` section);
/// the config and the port.
fn wal_config(url: &str, schema: &str, wal: &str) -> (Config, u16) {
    let port = free_port();
    let config = Config::with_broker_at(
        url,
        schema,
        &format!("127.0.0.1:{port}"),
        &format!("[broker]\nkind = \"stdout\"\n[wal]\nenabled = true\n{wal}"),
    );
    (config, port)
}

/// The slot `outbox migrate` reported, from its output.
fn migrated_slot(output: &str) -> String {
    output
        .split("replication slot ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no slot in {output}"))
        .to_string()
}

/// Wait until the relay on `port` is ready and its first stats refresh reported
/// the slot's lag; its slot gauge is then 1.
async fn wait_until_ready(port: u16) {
    wait_for("/readyz 200", WAIT, || {
        get(port, "/readyz").map(|r| r.0) == Some(200)
    })
    .await;
    let mut metrics = String::new();
    wait_for("the slot's lag in /metrics", WAIT, || {
        metrics = get(port, "/metrics").map(|r| r.1).unwrap_or_default();
        sample(&metrics, "outbox_wal_slot_lag_bytes").is_some()
    })
    .await;
    assert_eq!(
        sample(&metrics, "outbox_wal_slot_usable"),
        Some(1.0),
        "{metrics}"
    );
}

/// Commit `transactions` transactions of `per_tx` events each with `wal` on `pool`;
/// their ids.
async fn write(
    pool: &sqlx::PgPool,
    wal: &WalOutbox,
    transactions: usize,
    per_tx: usize,
) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for t in 0..transactions {
        let events: Vec<NewEvent> = (0..per_tx)
            .map(|i| event(&format!("a{}", i % 7), t * per_tx + i))
            .collect();
        let tx = pool.begin().await.unwrap();
        ids.extend(wal.commit(tx, &events).await.unwrap());
    }
    ids
}

/// Wait until `relay` published every one of `ids`, then stop it; what it
/// published.
async fn published_all(relay: RelayProcess, ids: &[Uuid]) -> Vec<Uuid> {
    let wanted: HashSet<Uuid> = ids.iter().copied().collect();
    wait_for("every event published", WAIT, || {
        wanted.is_subset(&relay.published_ids().into_iter().collect())
    })
    .await;
    let (status, published) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    published
}

/// `published` is `written`, each once, in any order.
fn assert_each_once(published: &[Uuid], written: &[Uuid], whose: &str) {
    let mut published = published.to_vec();
    let mut written = written.to_vec();
    published.sort();
    written.sort();
    assert_eq!(
        published, written,
        "{whose}: published is not what was written, once each"
    );
}

/// Two databases of one server (staging and production on one cluster), the same
/// schema and table in WAL mode in both: each `outbox migrate` creates a slot of
/// its own (the default name includes the database), each relay is ready, and
/// every event committed in each database while both relays run is published
/// once, by its own database's relay.
#[tokio::test(flavor = "multi_thread")]
async fn two_databases_of_one_server_each_relay_their_own_wal_events() {
    let here = TestOutbox::new().await.unwrap();
    let _names = DropSlot::defaults(&here).await;
    let other = TestDatabase::create().await;
    let schema = here.tables.schema().as_str();
    let (config_here, port_here) = wal_config(&database_url(), schema, "");
    let (config_other, port_other) = wal_config(&other.url, schema, "");

    let slot_here = migrated_slot(&run_ok(&config_here.path, &["migrate"]));
    let migrated_other = run_ok(&config_other.path, &["migrate"]);
    assert!(migrated_other.contains("created"), "{migrated_other}");
    let slot_other = migrated_slot(&migrated_other);
    assert_ne!(slot_here, slot_other, "one slot name for two databases");
    assert!(slot_other.contains(&other.name), "{slot_other}");
    run_ok(&config_here.path, &["check"]);
    run_ok(&config_other.path, &["check"]);

    let relay_here = RelayProcess::start(&config_here.path);
    let relay_other = RelayProcess::start(&config_other.path);
    wait_until_ready(port_here).await;
    wait_until_ready(port_other).await;

    let wal_here = here.wal().await.unwrap();
    let wal_other = WalOutbox::connect(&mut other.pool.acquire().await.unwrap(), &here.tables)
        .await
        .unwrap();
    assert_eq!(wal_other.slot().as_str(), slot_other);
    let (mut written_here, mut written_other) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        written_here.extend(write(&here.pool, &wal_here, 2, 20).await);
        written_other.extend(write(&other.pool, &wal_other, 2, 20).await);
    }
    let published_here = published_all(relay_here, &written_here).await;
    let published_other = published_all(relay_other, &written_other).await;
    assert_each_once(&published_here, &written_here, "this database's relay");
    assert_each_once(
        &published_other,
        &written_other,
        "the other database's relay",
    );
    here.drop_schema().await.unwrap();
}

/// A slot of another database under the name this database's outbox is configured
/// with (`[wal] slot`, the same in both): `migrate` refuses it, naming the
/// database that owns it, and changes nothing; `check` refuses it the same way; a
/// producer is refused; the relay runs but is not ready, says why on `/readyz`,
/// sets `outbox_wal_slot_usable` to 0 and logs it once.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_of_another_database_is_refused_everywhere_and_the_relay_is_not_ready() {
    let here = TestOutbox::new().await.unwrap();
    let other = TestDatabase::create().await;
    let tag = &Uuid::new_v4().simple().to_string()[..12];
    let slot = Ident::new("slot", &format!("outbox_test_wal_{tag}")).unwrap();
    let _cleanup = DropSlot::named(&slot);
    let wal = format!("slot = \"{slot}\"\npublication = \"{slot}\"\n");
    let schema = here.tables.schema().as_str();
    let (config_here, _) = wal_config(&database_url(), schema, &wal);
    let (config_other, port) = wal_config(&other.url, schema, &wal);
    let here_db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&here.pool)
        .await
        .unwrap();
    assert!(run_ok(&config_here.path, &["migrate"]).contains("created"));
    let owner = format!(
        "replication slot {slot} belongs to database {here_db}, not to {}",
        other.name
    );

    let stderr = refused(&config_other.path, &["migrate"]);
    assert!(stderr.contains(&owner), "{stderr}");
    let (schemas, publications): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_namespace WHERE nspname = $1), \
                (SELECT count(*) FROM pg_publication WHERE pubname = $2)",
    )
    .bind(schema)
    .bind(slot.as_str())
    .fetch_one(&other.pool)
    .await
    .unwrap();
    assert_eq!(
        (schemas, publications),
        (0, 0),
        "a refused migrate changed the database"
    );

    // The schema migrated by other means: `check` reaches the slot and refuses it.
    pgoutbox_postgres::migrate(&other.pool, &here.tables)
        .await
        .unwrap();
    let stderr = refused(&config_other.path, &["check"]);
    assert!(stderr.contains(&owner), "{stderr}");
    let mut conn = other.pool.acquire().await.unwrap();
    match WalOutbox::connect_to_slot(&mut conn, &here.tables, &slot).await {
        Err(Error::WalSlot { reason, .. }) => assert!(reason.contains(&owner), "{reason}"),
        other => panic!("a producer of the other database was not refused: {other:?}"),
    }
    drop(conn);

    let relay = RelayProcess::start(&config_other.path);
    let mut answer = None;
    wait_for("/readyz naming the slot's database", WAIT, || {
        answer = get(port, "/readyz");
        answer
            .as_ref()
            .is_some_and(|(status, body)| *status == 503 && body.contains(&owner))
    })
    .await;
    let body = answer.map(|(_, body)| body).unwrap_or_default();
    assert!(body.starts_with("not ready: WAL slot: "), "{body}");
    let metrics = get(port, "/metrics").unwrap().1;
    assert_eq!(
        sample(&metrics, "outbox_wal_slot_usable"),
        Some(0.0),
        "{metrics}"
    );
    let log = relay.log();
    let (status, published) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    assert!(published.is_empty());
    assert_eq!(log.count("cannot carry its events"), 1, "{:?}", log.lines());
    here.drop_schema().await.unwrap();
}

/// An outbox in a schema short enough for the name earlier versions gave its
/// slot by default (`pgoutbox_<schema>_<table>`, at most 63 bytes).
async fn outbox_with_a_short_schema() -> TestOutbox {
    let pool = pgoutbox_postgres::testing::pool(8).await.unwrap();
    let schema = format!("outbox_up_{}", &Uuid::new_v4().simple().to_string()[..12]);
    let tables = Tables::in_schema(&schema).unwrap();
    pgoutbox_postgres::migrate(&pool, &tables).await.unwrap();
    TestOutbox {
        outbox: Outbox::new(tables.clone()),
        pool,
        tables,
    }
}

/// A deployment made before slot names included the database: its slot and
/// publication are `pgoutbox_<schema>_<table>`, and events committed before the
/// upgrade wait in the slot. After the upgrade, `migrate` and `check` keep that
/// slot (no second one is made), producers write for it, and the relay publishes
/// every event, from before the upgrade and after, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_made_under_the_former_default_name_keeps_its_events_across_the_upgrade() {
    let outbox = outbox_with_a_short_schema().await;
    let former = slot::former_default_name(&outbox.tables).unwrap();
    let publication = default_publication(&outbox);
    assert_eq!(
        former.as_str(),
        publication.as_str(),
        "the former defaults were one name"
    );
    let _cleanup = DropSlot::named(&former);
    // What the earlier version's `outbox migrate` made, and its producers wrote.
    slot::create(&outbox.pool, &former, &publication)
        .await
        .unwrap();
    let before_upgrade = outbox.wal_to_slot(&former).await.unwrap();
    let mut written = write(&outbox.pool, &before_upgrade, 3, 10).await;

    let (config, port) = wal_config(&database_url(), outbox.tables.schema().as_str(), "");
    let migrated = run_ok(&config.path, &["migrate"]);
    assert!(
        migrated.contains(&format!(
            "replication slot {former} exists (the name earlier versions gave it by default; kept)"
        )),
        "{migrated}"
    );
    let checked = run_ok(&config.path, &["check"]);
    assert!(
        checked.contains(&format!("slot {former} (the name")),
        "{checked}"
    );
    let mut conn = outbox.pool.acquire().await.unwrap();
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let default = slot::default_name(&database, &outbox.tables).unwrap();
    assert!(
        !slot::exists(&mut *conn, &default).await.unwrap(),
        "a second slot was made"
    );
    drop(conn);

    let after_upgrade = outbox.wal().await.unwrap();
    assert_eq!(after_upgrade.slot(), &former);
    written.extend(write(&outbox.pool, &after_upgrade, 3, 10).await);
    let relay = RelayProcess::start(&config.path);
    wait_until_ready(port).await;
    written.extend(write(&outbox.pool, &after_upgrade, 2, 10).await);
    let published = published_all(relay, &written).await;
    assert_each_once(&published, &written, "the relay");
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
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let _slot = DropSlot::defaults(&outbox).await;
    let stream = format!("OUTBOX_WALSQL_TEST_{tag}");
    let config = Config::with_broker(
        outbox.tables.schema().as_str(),
        "0",
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nsubject_prefix = \"walsqltest{tag}\"\n\
             ensure_stream = \"{stream}\"\n[wal]\nenabled = true\n"
        ),
    );
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
