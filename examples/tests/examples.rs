//! Every example binary run as a user runs it (`--orders 3`) against the real
//! PostgreSQL and its real broker: it exits 0 once each order's event was published,
//! and consumed through the adapter's consumer helper, which decodes the typed
//! `OrderCreated`. Also: `--help`, bad arguments, and no password in any output.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Output};

/// A password the tests put into URLs; no output may contain it.
const SENTINEL: &str = "pw-sentinel-0xC0FFEE";

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// `DATABASE_URL` with a password: PostgreSQL here trusts local connections, so the
/// password is accepted and ignored, and must never be printed.
fn database_url_with_password() -> String {
    database_url().replacen("://postgres@", &format!("://postgres:{SENTINEL}@"), 1)
}

/// What a test script exported.
fn env(name: &str) -> String {
    pgoutbox_core::testing::exported(name, "scripts/test.sh, moto.sh or tansu.sh")
}

fn run(bin: &str, args: &[&str], vars: &[(&str, String)]) -> Output {
    let mut command = Command::new(bin);
    command
        .args(args)
        .env("DATABASE_URL", database_url_with_password());
    for (name, value) in vars {
        command.env(name, value);
    }
    command.output().expect("run the example")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The event ids of the orders an example created, from its
/// `<name>: created order <n> for <customer> (event <id>)` lines.
fn created_event_ids<'a>(name: &str, stderr: &'a str) -> Vec<&'a str> {
    stderr
        .lines()
        .filter(|l| l.starts_with(&format!("{name}: created order ")))
        .map(|l| {
            l.rsplit("(event ")
                .next()
                .and_then(|id| id.strip_suffix(')'))
                .unwrap_or_else(|| panic!("no event id in: {l}"))
        })
        .collect()
}

/// The example ran to completion with `--orders 3`: exit 0, three orders created,
/// the event of each consumed with its typed payload decoded, and no password printed.
/// (A durable queue may also hold events of an earlier, interrupted run: extra
/// lines are allowed, this run's events must all be there.)
fn assert_demo(name: &str, out: &Output) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{stderr}\n{stdout}",
        out.status
    );
    let created = created_event_ids(name, &stderr);
    assert_eq!(created.len(), 3, "{name}: orders created:\n{stderr}");
    // `billing: order.created event <id>[ (partition, offset)]: order <n> for
    // <customer>: <total> cents`, printed from the decoded `OrderCreated`.
    for id in created {
        let line = format!("billing: order.created event {id}");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&line) && l.contains(": order ") && l.ends_with(" cents")),
            "{name}: event {id} was not consumed and decoded:\n{stdout}"
        );
    }
    assert!(
        stderr.contains(&format!("{name}: published 3 events, processed ")),
        "{stderr}"
    );
    assert!(
        !stdout.contains(SENTINEL) && !stderr.contains(SENTINEL),
        "{name} printed a password:\n{stderr}\n{stdout}"
    );
}

/// Run the example `name` with `--orders 3` and these variables, and check the demo.
fn run_demo(name: &str, bin: &str, vars: &[(&str, String)]) -> Output {
    let out = run(bin, &["--orders", "3"], vars);
    assert_demo(name, &out);
    out
}

#[test]
fn quickstart_publishes_its_orders_and_exits() {
    let out = run(env!("CARGO_BIN_EXE_quickstart"), &["--orders", "3"], &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    // The stdout publisher: one JSON line per event, the typed payload inside.
    let events: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    for event in &events {
        assert_eq!(event["event_type"], "order.created", "{event}");
        assert!(event["payload"]["total_cents"].is_i64(), "{event}");
    }
    // This run's three events are all published. The outbox is durable, so an
    // earlier run stopped between an order's commit and its publication (the
    // README's quickstart runs until Ctrl-C) left events that this run publishes
    // too: extra lines are allowed, and the count printed covers them.
    let created = created_event_ids("quickstart", &stderr);
    assert_eq!(created.len(), 3, "orders created:\n{stderr}");
    for id in &created {
        assert!(
            events.iter().any(|e| e["id"] == *id),
            "event {id} was not published:\n{stdout}"
        );
    }
    assert!(
        stderr.contains(&format!("quickstart: published {} events", events.len())),
        "{stderr}"
    );
    assert!(!stdout.contains(SENTINEL) && !stderr.contains(SENTINEL));
}

#[test]
fn tenants_are_relayed_by_one_discovery_including_a_late_one() {
    let out = run(env!("CARGO_BIN_EXE_tenants"), &[], &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let mut per_tenant = std::collections::BTreeMap::<String, usize>::new();
    for line in stdout.lines() {
        let event: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let tenant = event["payload"]["tenant"].as_str().unwrap_or_default();
        *per_tenant.entry(tenant.to_string()).or_default() += 1;
    }
    let expected: std::collections::BTreeMap<String, usize> = [("a", 2), ("b", 2), ("c", 2)]
        .map(|(t, n)| (t.to_string(), n))
        .into();
    assert_eq!(per_tenant, expected, "{stdout}");
    assert!(
        stderr.contains("tenants: relayed example_tenant_a, example_tenant_b, example_tenant_c"),
        "{stderr}"
    );
}

#[test]
fn help_describes_every_example_and_bad_arguments_are_named() {
    for bin in [
        env!("CARGO_BIN_EXE_quickstart"),
        env!("CARGO_BIN_EXE_nats"),
        env!("CARGO_BIN_EXE_amqp"),
        env!("CARGO_BIN_EXE_kafka"),
        env!("CARGO_BIN_EXE_sqs"),
    ] {
        let help = run(bin, &["--help"], &[]);
        let stdout = text(&help.stdout);
        assert!(
            help.status.success(),
            "{bin} --help: {}",
            text(&help.stderr)
        );
        assert!(stdout.contains("--orders <N>"), "{bin}: {stdout}");
        assert!(stdout.contains("--forever"), "{bin}: {stdout}");
        assert!(stdout.contains("schema `example_"), "{bin}: {stdout}");

        let bad = run(bin, &["--orders", "many"], &[]);
        let stderr = text(&bad.stderr);
        assert!(!bad.status.success(), "{bin} accepted `--orders many`");
        assert!(
            stderr.contains("invalid value 'many' for '--orders <N>'"),
            "{bin}: {stderr}"
        );
    }
}

/// An unreachable database is one line naming where, without the password.
#[test]
fn an_unreachable_database_is_named_without_its_password() {
    let out = run(
        env!("CARGO_BIN_EXE_quickstart"),
        &["--orders", "1"],
        &[(
            "DATABASE_URL",
            format!("postgres://postgres:{SENTINEL}@127.0.0.1:1/test"),
        )],
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("quickstart: cannot connect to postgres://postgres:***@127.0.0.1:1/test"),
        "{stderr}"
    );
    assert!(!stderr.contains(SENTINEL), "{stderr}");
}

#[test]
fn nats_example_consumes_its_typed_events() {
    let url = env("OUTBOX_NATS_URL").replacen("nats://", &format!("nats://app:{SENTINEL}@"), 1);
    let out = run_demo(
        "nats",
        env!("CARGO_BIN_EXE_nats"),
        &[("OUTBOX_NATS_URL", url)],
    );
    assert!(
        text(&out.stderr).contains("nats: publishing to nats://app:***@"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn amqp_example_consumes_its_typed_events() {
    run_demo(
        "amqp",
        env!("CARGO_BIN_EXE_amqp"),
        &[("OUTBOX_AMQP_URL", env("OUTBOX_AMQP_URL"))],
    );
}

/// On librdkafka's mock cluster (no `OUTBOX_KAFKA_BROKERS`, as the README runs it),
/// then on tansu: one after the other, as both use the schema `example_kafka`.
#[test]
fn kafka_example_consumes_its_typed_events_on_the_mock_cluster_and_on_tansu() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kafka"));
    command
        .args(["--orders", "3"])
        .env("DATABASE_URL", database_url_with_password())
        .env_remove("OUTBOX_KAFKA_BROKERS");
    assert_demo("kafka", &command.output().unwrap());

    run_demo(
        "kafka",
        env!("CARGO_BIN_EXE_kafka"),
        &[("OUTBOX_KAFKA_BROKERS", env("OUTBOX_TANSU_BROKERS"))],
    );
}

#[test]
fn sqs_example_consumes_its_typed_events() {
    run_demo(
        "sqs",
        env!("CARGO_BIN_EXE_sqs"),
        &[
            ("OUTBOX_SQS_ENDPOINT", env("OUTBOX_SQS_ENDPOINT")),
            ("OUTBOX_SQS_QUEUE", "example-orders.fifo".to_string()),
        ],
    );
}

/// The `outbox` command line built with a broker of the example's own
/// (`custom_broker`, a JSON-lines file): `migrate`, then `relay` publishes every
/// event to the file and stops cleanly on SIGTERM; `stats` runs on the same config;
/// a misspelt broker section or key is a one-line config error.
#[cfg(feature = "custom-broker")]
#[tokio::test(flavor = "multi_thread")]
async fn custom_broker_example_runs_the_outbox_binary_with_its_own_publisher() {
    use pgoutbox::postgres::{Outbox, Tables};
    use pgoutbox::NewEvent;
    use std::time::{Duration, Instant};

    let bin = env!("CARGO_BIN_EXE_custom_broker");
    let dir = tempfile::tempdir().unwrap();
    let events_file = dir.path().join("events.jsonl");
    let schema = format!(
        "example_custom_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let write_config = |broker: &str| {
        let path = dir.path().join("outbox.toml");
        std::fs::write(
            &path,
            format!(
                "[database]\nurl = \"{}\"\n[tables]\nschema = \"{schema}\"\n\
                 [relay]\npoll_interval = \"50ms\"\n[http]\nlisten = \"0\"\n{broker}",
                database_url_with_password()
            ),
        )
        .unwrap();
        path
    };
    let good = format!(
        "[broker]\nkind = \"jsonl-file\"\n[broker.jsonl-file]\npath = \"{}\"\n",
        events_file.display()
    );
    let config = write_config(&good);
    let outbox_cmd = |args: &[&str]| {
        let mut command = Command::new(bin);
        command.arg("--config").arg(&config).args(args);
        command
    };
    let migrated = outbox_cmd(&["migrate"]).output().unwrap();
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));

    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let outbox = Outbox::new(Tables::in_schema(&schema).unwrap());
    let events: Vec<NewEvent> = (0..40)
        .map(|i| {
            NewEvent::new(
                "order",
                format!("{}", i % 4),
                "order.created",
                &serde_json::json!({ "n": i }),
            )
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let ids = outbox.enqueue_many(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();

    let relay = outbox_cmd(&["relay"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let published = loop {
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&events_file)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let seen: std::collections::HashSet<String> = lines
            .iter()
            .map(|l| l["id"].as_str().unwrap().to_string())
            .collect();
        if ids.iter().all(|id| seen.contains(&id.to_string())) {
            break lines;
        }
        assert!(
            Instant::now() < deadline,
            "not every event reached the file within 60 s: {} of {}",
            seen.len(),
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Per-aggregate order holds in the file.
    for aggregate in ["0", "1", "2", "3"] {
        let ns: Vec<i64> = published
            .iter()
            .filter(|l| l["aggregate_id"] == aggregate)
            .map(|l| l["payload"]["n"].as_i64().unwrap())
            .collect();
        assert!(ns.windows(2).all(|w| w[0] < w[1]), "{aggregate}: {ns:?}");
    }
    let terminated = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    let stopped = relay.wait_with_output().unwrap();
    let stderr = text(&stopped.stderr);
    assert!(stopped.status.success(), "{stderr}");
    assert!(stderr.contains("broker=jsonl-file"), "{stderr}");
    assert!(!stderr.contains(SENTINEL), "{stderr}");

    let stats = outbox_cmd(&["stats", "--json"]).output().unwrap();
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    assert!(
        text(&stats.stdout).contains("\"pending\":0"),
        "{}",
        text(&stats.stdout)
    );

    for (broker, needle) in [
        (
            good.replace("[broker.jsonl-file]", "[broker.jsonl-fil]"),
            // The built-in brokers listed between depend on the features compiled.
            "unknown broker section [broker.jsonl-fil] (brokers of this binary: stdout, ",
        ),
        (
            good.replace("path =", "pat ="),
            "broker jsonl-file: [broker.jsonl-file]: unknown field `pat`",
        ),
        (
            "[broker]\nkind = \"jsonl\"\n".to_string(),
            "unknown broker `jsonl` (broker.kind or OUTBOX_BROKER): expected one of stdout, nats, amqp, kafka, sqs, jsonl-file",
        ),
    ] {
        write_config(&broker);
        let out = outbox_cmd(&["relay"]).output().unwrap();
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(needle), "`{needle}` not in: {stderr}");
    }

    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}
