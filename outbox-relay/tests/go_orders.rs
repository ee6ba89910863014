//! The example service written in Go (examples/go-orders): it writes orders and
//! their events with the seed article's own statements (database/sql, lib/pq, no
//! outbox library) into an outbox that `outbox migrate` created; the `outbox`
//! binary relays them to NATS JetStream; the Go consumer deduplicates them with
//! the inbox table. Every event arrives once, per order in the order written, with
//! its id and payload; a second consumer replaying the stream applies nothing.
//!
//! Needs Go and Debian's lib/pq and nats.go: scripts/test.sh installs them
//! (scripts/go.sh) and exports OUTBOX_GO and OUTBOX_GOPATH; without them this test
//! fails, naming what is missing.
#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{command, wait_until_drained, Config, RelayProcess};
use pgoutbox_postgres::testing::{database_url, TestOutbox};
use uuid::Uuid;

const ORDERS: usize = 60;

/// Build the Go example in a temporary folder; the path of the program.
fn build_go_example(dir: &Path) -> PathBuf {
    let go = std::env::var("OUTBOX_GO").unwrap_or_else(|_| "go".into());
    let gopath = std::env::var("OUTBOX_GOPATH").unwrap_or_else(|_| "/usr/share/gocode".into());
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/go-orders");
    let program = dir.join("orders");
    let output = Command::new(&go)
        .args(["build", "-o"])
        .arg(&program)
        .arg("main.go")
        .current_dir(&source)
        // Debian's packaged libraries, nothing fetched: GOPATH mode, no proxy.
        .env("GO111MODULE", "off")
        .env("GOPATH", &gopath)
        .env("GOFLAGS", "")
        .env("GOPROXY", "off")
        .env("GOCACHE", dir.join("cache"))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `{go}` ({e}): install golang-go, golang-github-lib-pq-dev and golang-github-nats-io-go-nats-dev (scripts/go.sh)")
        });
    assert!(
        output.status.success(),
        "go build of examples/go-orders failed (GOPATH {gopath}; scripts/go.sh installs the libraries):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    program
}

/// Run the Go program with `args` against `schema`; its standard output.
fn run_go(program: &Path, schema: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .arg("-schema")
        .arg(schema)
        .args(args)
        .env("DATABASE_URL", database_url())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "orders {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Events as (id, aggregate id, type, payload): `columns` of `from` (a table of
/// the outbox's schema and its ORDER BY).
async fn events_in(
    outbox: &TestOutbox,
    columns: &str,
    from: &str,
) -> Vec<(Uuid, String, String, serde_json::Value)> {
    sqlx::query_as(&format!(
        "SELECT {columns} FROM {}.{from}",
        outbox.tables.schema().quoted()
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_go_service_writes_with_the_seed_statements_and_its_consumer_sees_each_event_once() {
    let dir = tempfile::tempdir().unwrap();
    let program = build_go_example(dir.path());
    // The outbox as `outbox migrate` creates it (TestOutbox migrates the same way).
    let outbox = TestOutbox::new().await.unwrap();
    let schema = outbox.tables.schema().as_str().to_owned();
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let (stream, prefix) = (format!("OUTBOX_GO_TEST_{tag}"), format!("gotest{tag}"));
    let config = Config::with_broker(
        &schema,
        "0",
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nsubject_prefix = \"{prefix}\"\n\
             ensure_stream = \"{stream}\"\n"
        ),
    );
    let migrated = command(&config.path, &["migrate"]).output().unwrap();
    assert!(migrated.status.success());

    // The Go service writes its orders before the relay runs, and reads the
    // seed's pending count.
    let produced = run_go(
        &program,
        &schema,
        &["produce", "-orders", &ORDERS.to_string()],
    );
    let events = 2 * ORDERS;
    assert!(
        produced.contains(&format!(
            "produced orders={ORDERS} events={events} pending={events}"
        )),
        "{produced}"
    );
    let written = events_in(
        &outbox,
        "id, aggregate_id, event_type, payload",
        "outbox_events ORDER BY seq",
    )
    .await;
    assert_eq!(written.len(), events);

    let relay = RelayProcess::start(&config.path);
    wait_until_drained(&outbox, Duration::from_secs(60)).await;
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());

    let url = pgoutbox_nats::testing::nats_url();
    let consume = |durable: &str| {
        run_go(
            &program,
            &schema,
            &[
                "consume",
                "-nats",
                &url,
                "-stream",
                &stream,
                "-subject",
                &format!("{prefix}.>"),
                "-durable",
                durable,
                "-expect",
                &events.to_string(),
                "-timeout",
                "60s",
            ],
        )
    };
    let first = consume("billing");
    assert!(
        first.contains(&format!("applied={events} duplicates=0")),
        "{first}"
    );
    // Another consumer replays the stream from its start: every event is a repeat.
    let replay = consume("billing_replay");
    assert!(
        replay.contains(&format!("applied=0 duplicates={events}")),
        "{replay}"
    );

    // What the consumer applied: each event once, with the id and payload the
    // Go service wrote, and each order's events in the order written.
    let applied = events_in(
        &outbox,
        "event_id, order_id, event_type, payload",
        "billing ORDER BY line",
    )
    .await;
    let mut sorted_applied = applied.clone();
    sorted_applied.sort_by_key(|(id, ..)| *id);
    let mut sorted_written = written.clone();
    sorted_written.sort_by_key(|(id, ..)| *id);
    assert_eq!(sorted_applied, sorted_written);
    let mut per_order: HashMap<&str, Vec<&str>> = HashMap::new();
    for (_, order, event_type, _) in &applied {
        per_order.entry(order).or_default().push(event_type);
    }
    assert_eq!(per_order.len(), ORDERS);
    assert!(per_order
        .values()
        .all(|types| types == &["order.created", "order.paid"]));

    let nats = pgoutbox_nats::async_nats::connect(url.as_str())
        .await
        .unwrap();
    pgoutbox_nats::async_nats::jetstream::new(nats)
        .delete_stream(&stream)
        .await
        .unwrap();
    outbox.drop_schema().await.unwrap();
}
