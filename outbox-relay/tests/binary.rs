//! The `outbox` binary run as a process against the real PostgreSQL, each test in
//! its own schema.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use common::{
    command, dead_count, drop_schema, enqueue, free_port, get, pending_ids, poll, sample, wait_for,
    wait_until_drained, Config, RelayProcess,
};

use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{NewEvent, PublishError, Relay};
use pgoutbox_postgres::testing::{database_url, TestOutbox};
use uuid::Uuid;

fn run(config: &Path, args: &[&str]) -> Output {
    command(config, args).output().expect("run outbox")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn ok(config: &Path, args: &[&str]) -> String {
    let out = run(config, args);
    assert!(
        out.status.success(),
        "outbox {args:?} failed: {}\n{}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Dead-letter `n` events (permanent failure) with an in-process relay.
async fn dead_letters(outbox: &TestOutbox, event_type: &str, n: usize) -> Vec<Uuid> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                "payment",
                // Aggregates of their own: a dead letter blocks its aggregate's next events.
                format!("{event_type}-{i}"),
                event_type,
                &serde_json::json!({}),
            )
        })
        .collect();
    let mut tx = outbox.pool.begin().await.unwrap();
    let ids = outbox.outbox.enqueue_many(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::new(
        outbox.store(),
        RecordingPublisher::failing_when(|_| Some(PublishError::permanent("refused by test"))),
    );
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.dead_lettered, n);
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_twice_is_fine() {
    let schema = format!("outbox_relay_test_{}", Uuid::new_v4().simple());
    let config = Config::for_schema(&schema, "0");
    let first = ok(&config.path, &["migrate"]);
    assert!(first.contains("up to date"), "{first}");
    ok(&config.path, &["migrate"]);
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{schema}.outbox_events"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(exists.is_some());
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_everything_and_stops_cleanly_on_sigterm() {
    let outbox = TestOutbox::new().await.unwrap();
    let config = Config::for_schema(outbox.tables.schema().as_str(), "0");
    let mut all: HashSet<Uuid> = enqueue(&outbox, 2000).await.into_iter().collect();

    // SIGTERM in the middle of the drain: what was not published is still pending.
    let relay = RelayProcess::start(&config.path);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (status, first) = relay.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit status {status}");
    let left: HashSet<Uuid> = pending_ids(&outbox).await.into_iter().collect();
    let published: HashSet<Uuid> = first.iter().copied().collect();
    assert_eq!(published.len(), first.len(), "duplicates on a clean stop");
    assert!(published.is_disjoint(&left));
    assert_eq!(
        published.union(&left).count(),
        all.len(),
        "events lost: {} published + {} pending of {}",
        published.len(),
        left.len(),
        all.len()
    );

    // A second run drains the rest, including events enqueued while it runs.
    let relay = RelayProcess::start(&config.path);
    all.extend(enqueue(&outbox, 100).await);
    wait_until_drained(&outbox, Duration::from_secs(60)).await;
    let (status, second) = relay.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit status {status}");
    let everything: HashSet<Uuid> = first.into_iter().chain(second).collect();
    assert_eq!(everything, all);
    assert!(pending_ids(&outbox).await.is_empty());
    outbox.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_and_health_endpoints() {
    let outbox = TestOutbox::new().await.unwrap();
    let (config, port) = Config::with_http(&outbox);
    dead_letters(&outbox, "payment.refused", 1).await;
    let ids = enqueue(&outbox, 30).await;
    let relay = RelayProcess::start(&config.path);

    let drained = |body: &str| {
        sample(body, "outbox_events_published_total") == Some(ids.len() as f64)
            && sample(body, "outbox_events_pending") == Some(0.0)
    };
    let metrics = poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || {
            get(port, "/metrics")
                .and_then(|(status, body)| (status == 200 && drained(&body)).then_some(body))
        },
    )
    .await
    .expect("metrics never showed the drain");
    let outbox_label = format!("outbox=\"{}.outbox_events\"", outbox.tables.schema());
    // Histograms with buckets (each with a bucket of its own), labelled with the outbox.
    for (histogram, bucket) in [
        ("outbox_batch_duration_seconds", "5"),
        ("outbox_claim_duration_seconds", "0.0005"),
    ] {
        assert!(
            metrics.lines().any(|l| l
                .starts_with(&format!("{histogram}_bucket{{"))
                && l.contains(&outbox_label)
                && l.contains(&format!("le=\"{bucket}\""))),
            "{histogram} must be a histogram with a bucket le={bucket}, labelled {outbox_label}:\n{metrics}"
        );
    }
    for name in [
        "outbox_events_published_total",
        "outbox_events_pending",
        "outbox_dead_letters",
    ] {
        assert!(
            metrics.contains(&format!("{name}{{{outbox_label}}}")),
            "{name} is not labelled {outbox_label}:\n{metrics}"
        );
    }
    assert_eq!(sample(&metrics, "outbox_dead_letters"), Some(1.0));
    // The broker's own share, per call (the publisher layer of the binary).
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("outbox_publisher_events_total{")
                && l.contains("publisher=\"stdout\"")
                && l.contains("outcome=\"published\"")
                && l.ends_with(&format!(" {}", ids.len()))),
        "published events per publisher:\n{metrics}"
    );
    assert!(
        metrics.lines().any(
            |l| l.starts_with("outbox_publisher_call_duration_seconds_bucket{")
                && l.contains("publisher=\"stdout\"")
        ),
        "publisher call duration must be a histogram:\n{metrics}"
    );
    for name in alert_metric_names() {
        if ONLY_AFTER_A_FAILURE.contains(&name.as_str()) {
            continue;
        }
        assert!(
            metrics.contains(&name),
            "alerts.yml uses {name}, not exported:\n{metrics}"
        );
    }
    assert_eq!(get(port, "/healthz").map(|r| r.0), Some(200));
    let ready = get(port, "/readyz").expect("readyz");
    assert_eq!(ready.0, 200, "{}", ready.1);

    let (status, published) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    assert_eq!(published.len(), ids.len());
    outbox.drop_schema().await.unwrap();
}

/// A relay whose claim loop hangs (its record waits on a row lock another
/// session holds) fails `/healthz` after `http.stuck_after`, stays ready, and is
/// live again once the loop moves.
#[tokio::test(flavor = "multi_thread")]
async fn healthz_fails_while_a_claim_loop_is_stuck() {
    let outbox = TestOutbox::new().await.unwrap();
    let (config, port) = Config::with_http(&outbox);
    let ids = enqueue(&outbox, 1).await;
    // Hold the event's row: the relay claims it (advisory lock), publishes it, and
    // its delete then waits for this transaction.
    let mut holder = outbox.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {}.outbox_events WHERE id = $1 FOR UPDATE",
        outbox.tables.schema().quoted()
    ))
    .bind(ids[0])
    .execute(&mut *holder)
    .await
    .unwrap();
    let mut cmd = command(&config.path, &["relay"]);
    cmd.env("OUTBOX_PUBLISH_TIMEOUT", "1s")
        .env("OUTBOX_HTTP_STUCK_AFTER", "2s");
    let relay = RelayProcess::spawn(cmd);

    let stuck = poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || get(port, "/healthz").and_then(|(status, body)| (status == 503).then_some(body)),
    )
    .await
    .expect("/healthz never reported the stuck loop");
    assert!(
        stuck.starts_with("stuck: a claim loop has not finished a cycle for"),
        "{stuck}"
    );
    assert!(stuck.contains("(http.stuck_after 2s)"), "{stuck}");
    assert_eq!(relay.published_ids(), ids, "published, not yet recorded");
    let ready = get(port, "/readyz").expect("readyz");
    assert_eq!(ready.0, 200, "stuck is not unready: {}", ready.1);

    holder.rollback().await.unwrap();
    wait_for("recovery on /healthz", Duration::from_secs(30), || {
        get(port, "/healthz").map(|r| r.0) == Some(200)
    })
    .await;
    assert!(
        pending_ids(&outbox).await.is_empty(),
        "recorded once the lock went"
    );
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    outbox.drop_schema().await.unwrap();
}

/// Labelled counters that appear with their first failed event, and the WAL
/// mode's gauges.
const ONLY_AFTER_A_FAILURE: &[&str] = &[
    "outbox_events_failed_total",
    "outbox_events_dead_lettered_total",
    // WAL mode only (tests/wal.rs checks them there).
    "outbox_wal_slot_lag_bytes",
    "outbox_wal_slot_usable",
];

/// Metric names (histogram series included) in the expressions of docs/alerts.yml.
fn alert_metric_names() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml");
    let text = std::fs::read_to_string(&path).expect("docs/alerts.yml");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("alerts.yml is YAML");
    let mut names = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let expr = rule["expr"].as_str().expect("expr");
            let mut found = false;
            for token in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if token.starts_with("outbox_") {
                    found = true;
                    names.push(token.to_string());
                }
            }
            assert!(found, "alert expression names no outbox metric: {expr}");
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letter_retry_makes_it_publishable_again() {
    let outbox = TestOutbox::new().await.unwrap();
    let config = Config::for_schema(outbox.tables.schema().as_str(), "0");
    let ids = dead_letters(&outbox, "payment.refused", 2).await;
    let target = ids[0].to_string();

    let listed = ok(&config.path, &["dead-letters", "list"]);
    assert!(
        listed.contains(&target) && listed.contains("refused by test"),
        "{listed}"
    );
    let shown = ok(&config.path, &["dead-letters", "show", &target, "--json"]);
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["id"], target.as_str());

    let dry = ok(
        &config.path,
        &["dead-letters", "retry", "--id", &target, "--dry-run"],
    );
    assert!(dry.contains("would retry 1"), "{dry}");
    assert_eq!(dead_count(&outbox).await, 2);

    // No terminal to ask on, no --yes: refused, nothing changed.
    let refused = run(&config.path, &["dead-letters", "retry", "--id", &target]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("--yes"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(dead_count(&outbox).await, 2);

    let done = ok(
        &config.path,
        &["dead-letters", "retry", "--id", &target, "--yes"],
    );
    assert!(done.contains("1 dead letter(s) retried"), "{done}");
    assert_eq!(dead_count(&outbox).await, 1);

    let relay = RelayProcess::start(&config.path);
    wait_until_drained(&outbox, Duration::from_secs(30)).await;
    let (status, published) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    assert_eq!(published, vec![ids[0]]);
    assert_eq!(dead_count(&outbox).await, 1);
    outbox.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_dry_run_deletes_nothing() {
    let outbox = TestOutbox::new().await.unwrap();
    let config = Config::for_schema(outbox.tables.schema().as_str(), "0");
    dead_letters(&outbox, "payment.refused", 3).await;
    dead_letters(&outbox, "payment.other", 1).await;

    let dry = ok(&config.path, &["dead-letters", "purge", "--dry-run"]);
    assert!(dry.contains("would purge 4"), "{dry}");
    assert_eq!(dead_count(&outbox).await, 4);

    let refused = run(&config.path, &["dead-letters", "purge"]);
    assert!(!refused.status.success());
    assert_eq!(dead_count(&outbox).await, 4);

    let none = ok(
        &config.path,
        &["dead-letters", "purge", "--older-than", "1h", "--yes"],
    );
    assert!(none.contains("no dead letters match"), "{none}");
    let by_error = ok(
        &config.path,
        &["dead-letters", "list", "--error", "REFUSED BY"],
    );
    assert!(by_error.contains("(4 dead letter(s))"), "{by_error}");
    let args = [
        "dead-letters",
        "purge",
        "--event-type",
        "payment.refused",
        "--error",
        "refused by test",
        "--yes",
    ];
    let out = run(&config.path, &args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let done = text(&out.stdout);
    assert!(done.contains("3 dead letter(s) purged"), "{done}");
    assert_eq!(dead_count(&outbox).await, 1);
    // The audit line, as the console writes it.
    let audit = text(&out.stderr);
    assert!(
        audit.contains("dead letters changed")
            && audit.contains("action=\"purge\"")
            && audit.contains("selection=event_type=\"payment.refused\" error=\"refused by test\"")
            && audit.contains("affected=3")
            && audit.contains("by=\"cli\""),
        "{audit}"
    );

    let stats = ok(&config.path, &["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["dead_letters"], 1);
    assert_eq!(stats["pending"], 0);
    assert_eq!(stats["in_flight"], 0);
    ok(&config.path, &["cleanup"]);
    outbox.drop_schema().await.unwrap();
}

/// Runs `outbox <args>` expecting a failure with one line on stderr containing
/// `needle`; returns that line.
fn fails_with(config: &Path, args: &[&str], env: &[(&str, &str)], needle: &str) -> String {
    let mut cmd = command(config, args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run outbox");
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success(),
        "{args:?} should fail; stderr: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "one line expected on stderr, got:\n{stderr}"
    );
    assert!(lines[0].starts_with("outbox: "), "{stderr}");
    assert!(lines[0].contains(needle), "`{needle}` not in: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Error {"),
        "{stderr}"
    );
    stderr
}

#[test]
fn bad_configuration_is_one_clear_line() {
    let unknown = Config::new("[relay]\nbatch_size = 10\nbatch_sise = 20\n");
    fails_with(&unknown.path, &["relay"], &[], "batch_sise");
    fails_with(&unknown.path, &["migrate"], &[], "line 3");

    let bad_table = Config::new(&format!(
        "[database]\nurl = \"{}\"\n[tables]\nevents_table = \"events; drop table x\"\n",
        database_url()
    ));
    fails_with(
        &bad_table.path,
        &["migrate"],
        &[],
        "invalid events table name",
    );

    // The URL's password is never printed.
    let unreachable = Config::new(
        "[database]\nurl = \"postgres://postgres:pw-sentinel@127.0.0.1:1/test\"\nconnect_timeout = \"3s\"\n[http]\nlisten = \"0\"\n",
    );
    let line = fails_with(
        &unreachable.path,
        &["relay"],
        &[],
        "cannot connect to the database at 127.0.0.1:1/test",
    );
    assert!(!line.contains("pw-sentinel"), "{line}");
    fails_with(&unreachable.path, &["stats"], &[], "cannot connect");

    let fine = Config::for_schema("public", "0");
    fails_with(
        &fine.path,
        &["relay"],
        &[("OUTBOX_BROKER", "carrier-pigeon")],
        "unknown broker `carrier-pigeon`",
    );
    fails_with(
        &fine.path,
        &["relay"],
        &[("OUTBOX_BATCH_SIZE", "lots")],
        "OUTBOX_BATCH_SIZE",
    );
    for (broker, compiled) in [
        ("nats", cfg!(feature = "nats")),
        ("amqp", cfg!(feature = "amqp")),
        ("kafka", cfg!(feature = "kafka")),
        ("sqs", cfg!(feature = "sqs")),
    ] {
        if !compiled {
            fails_with(
                &fine.path,
                &["relay"],
                &[("OUTBOX_BROKER", broker)],
                &format!("broker `{broker}` is not compiled into this binary"),
            );
        }
    }
    let no_source = Config::new("[envelope]\nformat = \"cloudevents-binary\"\n");
    fails_with(
        &no_source.path,
        &["relay"],
        &[],
        "envelope: the CloudEvents envelope needs a source",
    );
    fails_with(
        &fine.path,
        &["check"],
        &[("OUTBOX_ENVELOPE", "cloudevent")],
        "unknown envelope \"cloudevent\"",
    );
    let bad_subject = Config::new(
        "[envelope]\nformat = \"cloudevents-structured\"\nsource = \"/s\"\nsubject = \"{tenant}\"\n",
    );
    fails_with(
        &bad_subject.path,
        &["relay"],
        &[],
        "unknown placeholder {tenant}",
    );
    let missing = PathBuf::from("/nonexistent/outbox.toml");
    fails_with(&missing, &["migrate"], &[], "cannot read config file");
}

/// `outbox migrate --print-sql` writes a script a migration tool applies in one
/// transaction; afterwards the outbox is complete (`stats` runs, which checks the
/// migrations). `--inbox-only` prints or creates the inbox table alone.
#[tokio::test(flavor = "multi_thread")]
async fn migrate_prints_sql_for_a_migration_tool_and_creates_the_inbox_alone() {
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let schema = format!("outbox_relay_test_{}", Uuid::new_v4().simple());
    let config = Config::for_schema(&schema, "0");
    let script = ok(&config.path, &["migrate", "--print-sql"]);
    assert!(
        script.contains(&format!("\"{schema}\".\"outbox_events\"")),
        "{script}"
    );
    let upgrade = ok(&config.path, &["migrate", "--print-sql", "--after", "3"]);
    assert!(
        upgrade.contains("-- migration 4:") && !upgrade.contains("-- migration 3:"),
        "{upgrade}"
    );
    let mut tx = pool.begin().await.unwrap();
    sqlx::raw_sql(&script).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let stats = ok(&config.path, &["stats", "--json"]);
    assert!(stats.contains("\"pending\""), "{stats}");

    let inbox_schema = format!("outbox_relay_test_{}", Uuid::new_v4().simple());
    let inbox_config = Config::for_schema(&inbox_schema, "0");
    let inbox_sql = ok(
        &inbox_config.path,
        &["migrate", "--print-sql", "--inbox-only"],
    );
    assert!(
        inbox_sql.contains("processed_events") && !inbox_sql.contains("outbox_events"),
        "{inbox_sql}"
    );
    let created = ok(&inbox_config.path, &["migrate", "--inbox-only"]);
    assert!(created.contains("inbox is up to date"), "{created}");
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 \
         ORDER BY 1",
    )
    .bind(&inbox_schema)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(tables, vec!["processed_events".to_string()]);
    for s in [&schema, &inbox_schema] {
        drop_schema(&pool, s).await;
    }
}

/// What scripts/pg-tls.sh exported; a missing one fails the test with how to get it.
fn tls_env(name: &str) -> String {
    pgoutbox_core::testing::exported(name, "scripts/pg-tls.sh")
}

/// The binary reaches PostgreSQL over TLS (`sslmode=verify-full` with a CA file in
/// the URL) as a role that may log in only over TLS, its password read from
/// `database.password_file`; an empty password file is a config error naming it.
#[tokio::test(flavor = "multi_thread")]
async fn the_binary_speaks_tls_to_postgres_with_a_password_from_a_file() {
    let schema = format!("outbox_relay_test_{}", Uuid::new_v4().simple());
    let url = format!(
        "postgres://{}@127.0.0.1:5432/test?sslmode=verify-full&sslrootcert={}",
        tls_env("OUTBOX_PG_TLS_USER"),
        tls_env("OUTBOX_TLS_CA")
    );
    let with_password_file = |file: &str| {
        Config::new(&Config::head(&url, &schema).replacen(
            "connect_timeout = \"5s\"",
            &format!("connect_timeout = \"5s\"\npassword_file = \"{file}\""),
            1,
        ))
    };
    let config = with_password_file(&tls_env("OUTBOX_PG_TLS_PASSWORD_FILE"));
    let migrated = ok(&config.path, &["migrate"]);
    assert!(migrated.contains("up to date"), "{migrated}");
    let stats = ok(&config.path, &["stats", "--json"]);
    assert!(stats.contains("\"pending\""), "{stats}");

    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty-password");
    std::fs::write(&empty, "\n").unwrap();
    let bad = with_password_file(&empty.display().to_string());
    fails_with(
        &bad.path,
        &["stats"],
        &[],
        &format!("database.password_file `{}` is empty", empty.display()),
    );

    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    drop_schema(&pool, &schema).await;
}

/// A relay newer than the outbox's schema says which migration is missing, and
/// `outbox migrate` brings the schema up to date.
#[tokio::test(flavor = "multi_thread")]
async fn relay_on_an_outbox_missing_a_migration_says_which() {
    let outbox = TestOutbox::new().await.unwrap();
    let schema = outbox.tables.schema();
    // As if the outbox had been migrated by the previous version.
    sqlx::raw_sql(&format!(
        "DROP FUNCTION {}.outbox_events_probe_due; \
         DELETE FROM {}.outbox_events_migrations WHERE version = 4",
        schema.quoted(),
        schema.quoted()
    ))
    .execute(&outbox.pool)
    .await
    .unwrap();
    let config = Config::for_schema(schema.as_str(), "0");
    fails_with(
        &config.path,
        &["relay"],
        &[],
        "lacks migration(s) 4 (probe_function): run `outbox migrate`",
    );
    ok(&config.path, &["migrate"]);
    assert!(
        pgoutbox_postgres::unapplied_migrations(&outbox.pool, &outbox.tables)
            .await
            .unwrap()
            .is_empty()
    );
    outbox.drop_schema().await.unwrap();
}

/// The relay against the real NATS JetStream (`OUTBOX_NATS_URL`, default 127.0.0.1:4222).
/// The binary publishes to NATS over TLS: a nats-server of the test's own with only a
/// TLS listener (the test CA's certificate), `tls_ca` in the config, the password
/// read from a file; the stream holds every event afterwards.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_to_nats_over_tls() {
    use pgoutbox_nats::testing::{TlsNatsServer, PASSWORD, USER};

    let server = TlsNatsServer::start(
        Path::new(&tls_env("OUTBOX_TLS_SERVER_CERT")),
        Path::new(&tls_env("OUTBOX_TLS_SERVER_KEY")),
    );
    let password_file = server.dir().join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let outbox = TestOutbox::new().await.unwrap();
    let stream = format!("OUTBOX_TLS_{}", &Uuid::new_v4().simple().to_string()[..12]);
    let config = Config::with_broker(
        outbox.tables.schema().as_str(),
        "0",
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nurl = \"{url}\"\ntls_ca = \"{ca}\"\n\
             user = \"{USER}\"\npassword_file = \"{password}\"\nsubject_prefix = \"tlstest\"\n\
             ensure_stream = \"{stream}\"\n",
            url = server.url(),
            ca = tls_env("OUTBOX_TLS_CA"),
            password = password_file.display(),
        ),
    );
    let ids = enqueue(&outbox, 20).await;
    let relay = RelayProcess::start(&config.path);
    wait_until_drained(&outbox, Duration::from_secs(30)).await;
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    assert_eq!(dead_count(&outbox).await, 0);

    let publisher = pgoutbox_nats::NatsConfig::new(server.url())
        .tls_ca_file(tls_env("OUTBOX_TLS_CA"))
        .user_password(USER, PASSWORD)
        .connect()
        .await
        .expect("connect over TLS to read the stream");
    let mut handle = publisher.jetstream().get_stream(&stream).await.unwrap();
    assert_eq!(
        handle.info().await.unwrap().state.messages,
        ids.len() as u64
    );
    outbox.drop_schema().await.unwrap();
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_to_nats_jetstream() {
    use pgoutbox_nats::async_nats;

    let outbox = TestOutbox::new().await.unwrap();
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let stream = format!("OUTBOX_RELAY_TEST_{tag}");
    let port = free_port();
    let config = Config::with_broker(
        outbox.tables.schema().as_str(),
        &format!("127.0.0.1:{port}"),
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nsubject_prefix = \"relaytest{tag}\"\n\
             ensure_stream = \"{stream}\"\n"
        ),
    );
    let ids = enqueue(&outbox, 20).await;
    let relay = RelayProcess::start(&config.path);
    wait_until_drained(&outbox, Duration::from_secs(30)).await;
    let ready = get(port, "/readyz").expect("readyz");
    assert_eq!(ready.0, 200, "{}", ready.1);
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    assert_eq!(dead_count(&outbox).await, 0);

    let url = pgoutbox_nats::testing::nats_url();
    let client = async_nats::connect(url.as_str()).await.unwrap();
    let jetstream = async_nats::jetstream::new(client);
    let mut handle = jetstream.get_stream(&stream).await.unwrap();
    let messages = handle.info().await.unwrap().state.messages;
    jetstream.delete_stream(&stream).await.unwrap();
    assert_eq!(messages, ids.len() as u64);
    outbox.drop_schema().await.unwrap();
}

/// `outbox check`: exit 0 with one line per part when the database is reachable,
/// the outbox migrated and the broker reachable; otherwise exit 1 naming the part
/// that failed (and never a password).
#[tokio::test(flavor = "multi_thread")]
async fn check_reports_the_database_and_the_broker() {
    let outbox = TestOutbox::new().await.unwrap();
    let config = Config::for_schema(outbox.tables.schema().as_str(), "0");
    let out = ok(&config.path, &["check"]);
    assert!(out.contains("config    ok"), "{out}");
    assert!(
        out.contains(&format!(
            "database  ok: reachable, outbox {}.outbox_events migrated",
            outbox.tables.schema().as_str()
        )),
        "{out}"
    );
    assert!(out.contains("broker    ok: stdout reachable"), "{out}");

    let unmigrated = Config::for_schema("outbox_check_no_such_schema", "0");
    let failed = run(&unmigrated.path, &["check"]);
    assert_eq!(failed.status.code(), Some(1));
    assert!(
        text(&failed.stderr).contains("run `outbox migrate`"),
        "{}",
        text(&failed.stderr)
    );

    if cfg!(feature = "nats") {
        let down = Config::with_broker(
            outbox.tables.schema().as_str(),
            "0",
            "[broker]\nkind = \"nats\"\n[broker.nats]\nurl = \"nats://app:pw-sentinel@127.0.0.1:1\"\n\
             timeout = \"1s\"\n",
        );
        let failed = run(&down.path, &["check"]);
        let stderr = text(&failed.stderr);
        assert_eq!(failed.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("outbox: broker nats: not reachable"),
            "{stderr}"
        );
        assert!(!stderr.contains("pw-sentinel"), "{stderr}");
    }
    outbox.drop_schema().await.unwrap();
}
