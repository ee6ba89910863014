//! The `outbox` binary relaying several outboxes: `[[outbox]]` entries in two
//! databases and `[tenants]` found by name while it runs, against the real
//! PostgreSQL.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
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

/// A database of its own for a test, dropped by [`drop_database`].
async fn create_database(admin: &PgPool, name: &str) -> (PgPool, String) {
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .database(name);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let url = format!("{}/{name}", database_url().rsplit_once('/').unwrap().0);
    (pool, url)
}

async fn drop_database(admin: &PgPool, pool: PgPool, name: &str) {
    pool.close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .execute(admin)
        .await
        .unwrap();
}

/// Sessions named `application_name` on the test database now.
async fn sessions_named(admin: &PgPool, application_name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND datname = current_database()",
    )
    .bind(application_name)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Events per tenant schema, and how many tenants: 49 found at start, one created
/// while the relay runs.
const TENANT_EVENTS: usize = 20;
const TENANTS: usize = 50;
/// The relay's pool size per database: the connection budget.
const BUDGET: i64 = 4;

/// One relay process for 50 tenant schemas found by name (one of them created
/// while it runs) and three configured outboxes in three databases (two under
/// names of their own): every event published once, per-aggregate order kept
/// per outbox, the labelled metrics adding up to the total, the test
/// database's relay sessions within the budget, and the admin commands over
/// all outboxes or the one `--outbox` names.
#[tokio::test(flavor = "multi_thread")]
async fn one_process_relays_configured_outboxes_and_tenants_found_while_running() {
    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&database_url())
        .await
        .unwrap();
    let (billing_db, shipping_db) = (
        format!("relay_billing_{tag}"),
        format!("relay_shipping_{tag}"),
    );
    let (billing_pool, billing_url) = create_database(&admin, &billing_db).await;
    let (shipping_pool, shipping_url) = create_database(&admin, &shipping_db).await;

    let here = TestOutbox::new().await.unwrap();
    let billing = TestOutbox::with_pool(billing_pool.clone()).await.unwrap();
    let shipping = TestOutbox::with_pool(shipping_pool.clone()).await.unwrap();
    let prefix = format!("relaytenants{tag}");
    let mut tenants = Vec::new();
    for i in 0..TENANTS - 1 {
        tenants.push(outbox_in(&here.pool, &format!("{prefix}_{i:02}")).await);
    }
    let port = free_port();
    // The relay's sessions get a name of their own: other `outbox` sessions may be
    // on the test database (a pooler keeps earlier tests' server connections).
    let application_name = format!("relaygroup_{tag}");
    let url = format!(
        "{}{}application_name={application_name}",
        database_url(),
        if database_url().contains('?') {
            '&'
        } else {
            '?'
        }
    );
    let config = Config::new(&format!(
        r#"{head}
[[outbox]]
schema = "{here_schema}"

[[outbox]]
name = "billing"
schema = "{billing_schema}"
database_url = "{billing_url}"
batch_size = 20

[[outbox]]
name = "shipping"
schema = "{shipping_schema}"
database_url = "{shipping_url}"

[tenants]
schemas = "{prefix}\\_%"
interval = "300ms"

[http]
listen = "127.0.0.1:{port}"
stats_refresh = "200ms"

[broker]
kind = "stdout"
"#,
        head = Config::head(&url, "unused")
            .replace("[tables]\nschema = \"unused\"\n", "")
            .replace(
                "connect_timeout = \"5s\"\n",
                &format!("connect_timeout = \"5s\"\nmax_connections = {BUDGET}\n")
            ),
        here_schema = here.tables.schema().as_str(),
        billing_schema = billing.tables.schema().as_str(),
        shipping_schema = shipping.tables.schema().as_str(),
    ));

    // `migrate` brings every outbox up to date: configured and tenants found now.
    let migrated = run_ok(&config.path, &["migrate"]);
    assert_eq!(
        migrated.matches("up to date").count(),
        3 + TENANTS - 1,
        "{migrated}"
    );

    // One dead letter in a tenant (an aggregate of its own), retried alone with
    // `--outbox` before the relay starts, so published with the rest.
    let first_tenant = tenants[0].clone();
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
    let listed = run_ok(&config.path, &["dead-letters", "list", "--json"]);
    let listed: Vec<serde_json::Value> = listed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        listed[0]["outbox"],
        first_tenant.tables.outbox_name().as_str()
    );
    assert_eq!(listed[0]["id"], dead[0].to_string());
    let retried = run_ok(
        &config.path,
        &[
            "dead-letters",
            "retry",
            "--outbox",
            &first_tenant.tables.outbox_name(),
            "--yes",
        ],
    );
    assert!(retried.contains("1 dead letter(s) retried"), "{retried}");

    // Each outbox's events in enqueue order (aggregate = index % 50, see `enqueue`).
    let mut runs: Vec<(String, Vec<Uuid>)> = vec![
        (here.tables.outbox_name(), enqueue(&here, 200).await),
        ("billing".to_string(), enqueue(&billing, 200).await),
        ("shipping".to_string(), enqueue(&shipping, 200).await),
    ];
    for tenant in &tenants {
        runs.push((
            tenant.tables.outbox_name(),
            enqueue(tenant, TENANT_EVENTS).await,
        ));
    }

    // The admin commands' sessions (named like the relay's: the same URL) are
    // gone before the relay starts: from here on every session of that name is
    // the relay's.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = sessions_named(&admin, &application_name).await;
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} sessions of the admin commands did not end within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let relay = RelayProcess::start(&config.path);
    // The relay sessions on the test database, sampled until everything is
    // published: never above the budget.
    let most = Arc::new(AtomicI64::new(0));
    let sampling = {
        let (admin, most, name) = (admin.clone(), Arc::clone(&most), application_name.clone());
        tokio::spawn(async move {
            loop {
                most.fetch_max(sessions_named(&admin, &name).await, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // A tenant created while the relay runs is found at its next look.
    let later = outbox_in(&here.pool, &format!("{prefix}_{:02}", TENANTS - 1)).await;
    runs.push((
        later.tables.outbox_name(),
        enqueue(&later, TENANT_EVENTS).await,
    ));
    tenants.push(later);

    let mut outboxes: Vec<&TestOutbox> = vec![&here, &billing, &shipping];
    outboxes.extend(tenants.iter());
    for outbox in &outboxes {
        wait_until_drained(outbox, Duration::from_secs(90)).await;
    }
    sampling.abort();
    let most = most.load(Ordering::Relaxed);
    assert!(
        (1..=BUDGET).contains(&most),
        "{most} relay sessions on the test database; the budget is {BUDGET}"
    );

    // Labelled metrics: each outbox's published count is its own, and they add
    // up to every event.
    let total: usize = runs.iter().map(|(_, ids)| ids.len()).sum::<usize>() + 1;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, metrics) = get(port, "/metrics").expect("metrics");
        assert_eq!(status, 200);
        let wrong: Vec<String> = runs
            .iter()
            .filter_map(|(name, ids)| {
                let want = ids.len() + usize::from(*name == first_tenant.tables.outbox_name());
                let got = labelled(&metrics, "outbox_events_published_total", name);
                (got != want as f64).then(|| format!("{name}: {got} of {want}"))
            })
            .collect();
        let sum: f64 = runs
            .iter()
            .map(|(name, _)| labelled(&metrics, "outbox_events_published_total", name))
            .sum();
        if wrong.is_empty() {
            assert_eq!(sum, total as f64);
            break;
        }
        assert!(Instant::now() < deadline, "published per outbox: {wrong:?}");
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
    assert_eq!(listed.len(), runs.len(), "{listed:?}");
    for (name, _) in &runs {
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
    let mut all: HashSet<Uuid> = runs
        .iter()
        .flat_map(|(_, ids)| ids.iter().copied())
        .collect();
    all.insert(dead[0]);
    assert_eq!(unique, all);
    // Per-aggregate order, per outbox: each aggregate's events arrived in the
    // order they were enqueued.
    let position: std::collections::HashMap<Uuid, usize> = published
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, i))
        .collect();
    for (name, ids) in &runs {
        for aggregate in 0..50 {
            let arrivals: Vec<usize> = ids
                .iter()
                .skip(aggregate)
                .step_by(50)
                .map(|id| position[id])
                .collect();
            assert!(
                arrivals.windows(2).all(|w| w[0] < w[1]),
                "{name}: aggregate {aggregate} out of order: {arrivals:?}"
            );
        }
    }

    for outbox in &outboxes {
        outbox.drop_schema().await.unwrap();
    }
    drop_database(&admin, billing_pool, &billing_db).await;
    drop_database(&admin, shipping_pool, &shipping_db).await;
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
