//! The `outbox` binary relaying several outboxes: `[[outbox]]` entries in two
//! databases and `[tenants]` found by name while it runs, against the real
//! PostgreSQL.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::str::FromStr;
use std::time::{Duration, Instant};

use common::{command, enqueue, free_port, get, wait_until_drained, Config, RelayProcess};
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{NewEvent, PublishError, Relay};
use pgoutbox_postgres::testing::{database_url, TestOutbox};
use pgoutbox_postgres::{Outbox, Tables};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use uuid::Uuid;

fn run_ok(config: &std::path::Path, args: &[&str]) -> String {
    let out = command(config, args).output().unwrap();
    assert!(
        out.status.success(),
        "outbox {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A migrated outbox in schema `schema` of `pool`'s database.
async fn outbox_in(pool: &PgPool, schema: &str) -> TestOutbox {
    let tables = Tables::in_schema(schema).unwrap();
    pgoutbox_postgres::migrate(pool, &tables).await.unwrap();
    TestOutbox {
        pool: pool.clone(),
        outbox: Outbox::new(tables.clone()),
        tables,
    }
}

/// The sum of the samples of `name` labelled `outbox="<outbox>"`.
fn labelled(metrics: &str, name: &str, outbox: &str) -> f64 {
    let label = format!("outbox=\"{outbox}\"");
    metrics
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(&label))
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// One relay process for two configured outboxes (one in another database, under
/// a name of its own) and the tenant schemas matching a pattern, one of them
/// created while it runs: every event published once, metrics labelled per
/// outbox, the admin commands over all outboxes or the one `--outbox` names.
#[tokio::test(flavor = "multi_thread")]
async fn one_process_relays_configured_outboxes_and_tenants_found_while_running() {
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&database_url())
        .await
        .unwrap();
    let other_db = format!("relay_group_{tag}");
    sqlx::query(&format!("CREATE DATABASE {other_db}"))
        .execute(&admin)
        .await
        .unwrap();
    let other_url = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .database(&other_db);
    let there = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(other_url)
        .await
        .unwrap();
    let other_db_url = format!("{}/{other_db}", database_url().rsplit_once('/').unwrap().0);

    let here = TestOutbox::new().await.unwrap();
    let billing = TestOutbox::with_pool(there.clone()).await.unwrap();
    let prefix = format!("relaytenants{tag}");
    let first_tenant = outbox_in(&here.pool, &format!("{prefix}_a")).await;
    let port = free_port();
    let config = Config::new(&format!(
        r#"{head}
[[outbox]]
schema = "{here_schema}"

[[outbox]]
name = "billing"
schema = "{billing_schema}"
database_url = "{other_db_url}"
batch_size = 20

[tenants]
schemas = "{prefix}\\_%"
interval = "300ms"

[http]
listen = "127.0.0.1:{port}"
stats_refresh = "200ms"

[broker]
kind = "stdout"
"#,
        head =
            Config::head(&database_url(), "unused").replace("[tables]\nschema = \"unused\"\n", ""),
        here_schema = here.tables.schema().as_str(),
        billing_schema = billing.tables.schema().as_str(),
    ));
    let names = [
        here.tables.outbox_name(),
        "billing".to_string(),
        first_tenant.tables.outbox_name(),
    ];

    // `migrate` brings every outbox up to date: configured and tenants found now.
    let migrated = run_ok(&config.path, &["migrate"]);
    assert_eq!(migrated.matches("up to date").count(), 3, "{migrated}");

    // One dead letter in the tenant (an aggregate of its own), for the admin commands.
    let dead = first_tenant
        .enqueue_committed(&[NewEvent::new(
            "payment",
            "refused-1",
            "payment.refused",
            &serde_json::json!({}),
        )])
        .await
        .unwrap();
    let report = Relay::new(
        first_tenant.store(),
        RecordingPublisher::failing_when(|_| Some(PublishError::permanent("refused by test"))),
    )
    .run_once()
    .await
    .unwrap();
    assert_eq!(report.dead_lettered, 1);
    let mut all: HashSet<Uuid> = HashSet::new();
    for outbox in [&here, &billing, &first_tenant] {
        all.extend(enqueue(outbox, 60).await);
    }

    let listed = run_ok(&config.path, &["dead-letters", "list", "--json"]);
    let listed: Vec<serde_json::Value> = listed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["outbox"], names[2].as_str());
    assert_eq!(listed[0]["id"], dead[0].to_string());

    let relay = RelayProcess::start(&config.path);
    // A tenant created while the relay runs is found at its next look.
    let later_tenant = outbox_in(&here.pool, &format!("{prefix}_b")).await;
    all.extend(enqueue(&later_tenant, 40).await);
    // The dead letter, retried in its outbox alone, is published too.
    let retried = run_ok(
        &config.path,
        &["dead-letters", "retry", "--outbox", &names[2], "--yes"],
    );
    assert!(retried.contains("1 dead letter(s) retried"), "{retried}");
    all.insert(dead[0]);

    let outboxes = [&here, &billing, &first_tenant, &later_tenant];
    for outbox in outboxes {
        wait_until_drained(outbox, Duration::from_secs(60)).await;
    }

    // Labelled metrics: each outbox's published count is its own.
    let expected = [
        (names[0].clone(), 60.0),
        (names[1].clone(), 60.0),
        (names[2].clone(), 61.0),
        (later_tenant.tables.outbox_name(), 40.0),
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, metrics) = get(port, "/metrics").expect("metrics");
        assert_eq!(status, 200);
        let counts: Vec<f64> = expected
            .iter()
            .map(|(name, _)| labelled(&metrics, "outbox_events_published_total", name))
            .collect();
        if counts
            .iter()
            .zip(&expected)
            .all(|(count, (_, want))| count == want)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "published counts per outbox {counts:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let health = get(port, "/healthz").expect("healthz");
    assert_eq!(health.0, 200, "{}", health.1);
    let ready = get(port, "/readyz").expect("readyz");
    assert_eq!(ready.0, 200, "{}", ready.1);

    // `stats` over every outbox, or the one selected.
    let stats = run_ok(&config.path, &["stats", "--json"]);
    let stats: Vec<serde_json::Value> = stats
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let listed: Vec<&str> = stats
        .iter()
        .map(|s| s["outbox"].as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 4, "{stats:?}");
    for (name, _) in &expected {
        assert!(
            listed.contains(&name.as_str()),
            "{name} missing in {listed:?}"
        );
    }
    assert!(stats.iter().all(|s| s["pending"] == 0), "{stats:?}");
    let one = run_ok(&config.path, &["stats", "--json", "--outbox", "billing"]);
    assert_eq!(one.lines().count(), 1, "{one}");
    assert!(one.contains("\"outbox\":\"billing\""), "{one}");
    let unknown = command(&config.path, &["stats", "--outbox", "nope"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--outbox nope: no such outbox; there are:") && stderr.contains("billing"),
        "{stderr}"
    );

    let (status, published) = relay.terminate(Duration::from_secs(25));
    assert!(status.success(), "exit status {status}");
    let unique: HashSet<Uuid> = published.iter().copied().collect();
    assert_eq!(unique.len(), published.len(), "duplicates on a clean run");
    assert_eq!(unique, all);

    for outbox in outboxes {
        outbox.drop_schema().await.unwrap();
    }
    there.close().await;
    sqlx::query(&format!("DROP DATABASE {other_db} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}

/// `[tables]` and `[[outbox]]` together, two entries of one name, `[[outbox]]`
/// with the WAL outbox: each refused with one line naming what is wrong.
#[test]
fn contradictory_outbox_lists_are_refused() {
    let cases = [
        (
            "[tables]\nschema = \"a\"\n[[outbox]]\nschema = \"b\"\n",
            "list every outbox as an [[outbox]] entry",
        ),
        (
            "[[outbox]]\nschema = \"a\"\n[[outbox]]\nschema = \"a\"\n",
            "outbox[1]: the name `a.outbox_events` is taken by outbox[0]",
        ),
        (
            "[[outbox]]\nschema = \"a\"\n[wal]\nenabled = true\n",
            "the WAL outbox is relayed alone",
        ),
        (
            "[[outbox]]\nschema = \"a\"\nworkers = 0\n",
            "outbox[0].workers = 0: must be between 1 and 64",
        ),
        ("[[outbox]]\nname = \"x\"\n", "missing field `schema`"),
        (
            "[tenants]\nschemas = \"t%\"\nintervall = \"1s\"\n",
            "intervall",
        ),
    ];
    for (text, needle) in cases {
        let config = Config::new(&format!("[database]\nurl = \"{}\"\n{text}", database_url()));
        let out = command(&config.path, &["stats"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {stderr}");
        assert!(stderr.contains(needle), "{text}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
}
