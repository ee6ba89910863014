//! A `RelayGroup` against the real PostgreSQL: 50 tenant schemas in one database
//! relayed by one group on one pool drain completely, each event once, in order per
//! aggregate, and the group never holds more connections than the pool allows
//! (seen from `pg_stat_activity`).
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
mod common;

use common::{fill, spawn_until_stopped};
use pgoutbox_core::testing::{check_first_arrivals, RecordingPublisher};
use pgoutbox_core::{telemetry, DynPublisher, NewEvent, RelayConfig};
use pgoutbox_postgres::testing::{self, database_url, TestOutbox};
use pgoutbox_postgres::RelayGroup;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::oneshot;
use uuid::Uuid;

const TENANTS: usize = 50;
const AGGREGATES: usize = 3;
const EVENTS_PER_AGGREGATE: usize = 4;
/// The group's connection budget in the database: its pool.
const BUDGET: u32 = 4;

/// Run `group` on a task of its own until the sender is used.
fn start(group: RelayGroup) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    spawn_until_stopped(|stopped| async move { group.run(stopped).await })
}

/// A pool of [`BUDGET`] connections whose sessions carry an application name of
/// their own (`prefix_<uuid>`, returned), to find them in `pg_stat_activity`.
async fn budget_pool(prefix: &str) -> (String, sqlx::PgPool) {
    let name = format!("{prefix}_{}", Uuid::new_v4().simple());
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .application_name(&name);
    let pool = PgPoolOptions::new()
        .max_connections(BUDGET)
        .connect_with(options)
        .await
        .unwrap();
    (name, pool)
}

/// Commit one event of `aggregate` to `outbox`; its id.
async fn commit_one(outbox: &TestOutbox, aggregate: &str) -> Uuid {
    let event = NewEvent::new("order", aggregate, "order.created", &serde_json::json!({}));
    outbox
        .enqueue_committed(std::slice::from_ref(&event))
        .await
        .unwrap();
    event.id
}

/// Wait until every one of `ids` is among `published()`, at most 10 s; `what`
/// names them in the failure.
async fn until_published(ids: &[Uuid], published: impl Fn() -> Vec<Uuid>, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let published: HashSet<Uuid> = published().into_iter().collect();
        if ids.iter().all(|id| published.contains(id)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not published within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`until_published`] for one event of one publisher; `what` names whose event.
async fn published_soon(publisher: &RecordingPublisher, id: Uuid, what: &str) {
    until_published(
        &[id],
        || publisher.published_ids(),
        &format!("{what} event"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_tenants_drain_through_one_group_within_its_connection_budget() {
    // The process's recorder: relays run on the runtime's worker threads. Only
    // this test installs one; the sums below count this test's outboxes only.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).unwrap();
    let (name, pool) = budget_pool("group_test").await;
    let observer = testing::pool(1).await.unwrap();

    // 50 schemas, each with 3 aggregates x 4 events committed before the group starts.
    let mut tenants = Vec::new();
    for _ in 0..TENANTS {
        let outbox = TestOutbox::with_pool(pool.clone()).await.unwrap();
        // Inserted interleaved (a0#0, a1#0, a2#0, a0#1, ...): each aggregate's run
        // is every third id.
        let ids = fill(&outbox, AGGREGATES, EVENTS_PER_AGGREGATE).await;
        let runs: Vec<Vec<Uuid>> = (0..AGGREGATES)
            .map(|a| ids.iter().skip(a).step_by(AGGREGATES).copied().collect())
            .collect();
        tenants.push((outbox, runs, Arc::new(RecordingPublisher::new())));
    }

    let mut group = RelayGroup::new();
    for (outbox, _, publisher) in &tenants {
        let publisher: Arc<dyn DynPublisher> = Arc::clone(publisher) as _;
        group.add(
            outbox.store(),
            publisher,
            // A claim without the shared probe's signal would wait 30 s.
            RelayConfig::default()
                .batch_size(5)
                .poll_interval(Duration::from_secs(30)),
        );
    }
    assert_eq!(group.names().len(), TENANTS);
    assert_eq!(group.databases(), 1, "clones of one pool share one probe");

    let (stop, running) = start(group);

    // Until every tenant's events are published (at most 60 s), watch how many
    // connections the group's pool holds.
    let total = TENANTS * AGGREGATES * EVENTS_PER_AGGREGATE;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most = 0;
    loop {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(&name)
                .fetch_one(&observer)
                .await
                .unwrap();
        most = most.max(held);
        let published: usize = tenants
            .iter()
            .map(|(_, _, p)| p.published_ids().iter().collect::<HashSet<_>>().len())
            .sum();
        if published == total {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{published} of {total} events published after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Idle now: new events of ten tenants are found by the shared probe (one
    // statement for all waiting relays), well before the relays' 30 s poll.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut late = Vec::new();
    for (outbox, runs, _) in tenants.iter_mut().take(10) {
        let id = commit_one(outbox, "late").await;
        runs.push(vec![id]);
        late.push(id);
    }
    until_published(
        &late,
        || {
            tenants
                .iter()
                .flat_map(|(_, _, p)| p.published_ids())
                .collect()
        },
        "events committed to idle tenants",
    )
    .await;

    // A tenant dropped while the group runs stops neither the others nor their
    // shared probe: a new event of another idle tenant is still found at once.
    let (gone, _, _) = tenants.remove(TENANTS - 1);
    let gone_name = gone.tables.outbox_name();
    gone.drop_schema().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (outbox, runs, publisher) = &mut tenants[10];
    let id = commit_one(outbox, "after").await;
    runs.push(vec![id]);
    published_soon(publisher, id, "after a tenant was dropped, another's").await;
    let _ = stop.send(());
    running.await.unwrap();

    assert!(
        most <= i64::from(BUDGET),
        "the group held {most} connections, its budget is {BUDGET}"
    );
    assert!(most >= 1, "the observer never saw the group's connections");
    for (outbox, runs, publisher) in &tenants {
        let published = publisher.published_ids();
        let unique: HashSet<&Uuid> = published.iter().collect();
        assert_eq!(
            unique.len(),
            published.len(),
            "{}: an event was published twice",
            outbox.tables.outbox_name()
        );
        check_first_arrivals(&published, runs).unwrap();
        // Nothing of another tenant reached this tenant's publisher.
        let own: HashSet<Uuid> = runs.iter().flatten().copied().collect();
        assert!(unique.iter().all(|id| own.contains(id)));
    }
    // Every outbox's published counter carries its name, and they add up.
    let published: std::collections::HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.kind() == MetricKind::Counter && key.key().name() == telemetry::EVENTS_PUBLISHED
        })
        .filter_map(|(key, _, _, value)| {
            let outbox = key.key().labels().find(|l| l.key() == "outbox")?;
            match value {
                DebugValue::Counter(n) => Some((outbox.value().to_string(), n)),
                _ => None,
            }
        })
        .collect();
    let mut expected = vec![(gone_name, (AGGREGATES * EVENTS_PER_AGGREGATE) as u64)];
    for (outbox, runs, _) in &tenants {
        let events = runs.iter().map(Vec::len).sum::<usize>() as u64;
        expected.push((outbox.tables.outbox_name(), events));
    }
    for (name, events) in &expected {
        assert_eq!(published.get(name), Some(events), "{name}'s counter");
    }
    let counted: u64 = expected.iter().map(|(name, _)| published[name]).sum();
    assert_eq!(
        counted,
        (total + 10 + 1) as u64,
        "the labelled counters add up to every event published"
    );

    for (outbox, _, _) in &tenants {
        outbox.drop_schema().await.unwrap();
    }
}

/// Outboxes of two databases in one group: each database's stores share their
/// own probe on their own pool, and both drain.
#[tokio::test(flavor = "multi_thread")]
async fn outboxes_in_two_databases_drain_in_one_group() {
    let admin = testing::pool(1).await.unwrap();
    let other = format!("group_test_{}", Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE DATABASE {other}"))
        .execute(&admin)
        .await
        .unwrap();
    let here = testing::pool(2).await.unwrap();
    let there = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            PgConnectOptions::from_str(&database_url())
                .unwrap()
                .database(&other),
        )
        .await
        .unwrap();

    let mut tenants = Vec::new();
    for pool in [&here, &here, &there, &there] {
        let outbox = TestOutbox::with_pool(pool.clone()).await.unwrap();
        let run = fill(&outbox, 1, 5).await;
        tenants.push((outbox, run, Arc::new(RecordingPublisher::new())));
    }
    let mut group = RelayGroup::new();
    for (outbox, _, publisher) in &tenants {
        let publisher: Arc<dyn DynPublisher> = Arc::clone(publisher) as _;
        group.add(outbox.store(), publisher, RelayConfig::default());
    }
    assert_eq!(group.databases(), 2, "one shared probe per pool");
    let (stop, running) = start(group);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !tenants
        .iter()
        .all(|(_, run, p)| p.published_ids().len() >= run.len())
    {
        assert!(Instant::now() < deadline, "not drained within 30 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    running.await.unwrap();
    for (_, run, publisher) in &tenants {
        check_first_arrivals(&publisher.published_ids(), std::slice::from_ref(run)).unwrap();
    }

    for (outbox, _, _) in &tenants {
        outbox.drop_schema().await.unwrap();
    }
    there.close().await;
    sqlx::query(&format!("DROP DATABASE {other} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}

/// Tenants come and go while the discovery runs: a schema created (and migrated)
/// later is relayed within a discovery interval, a dropped one has its relay
/// stopped, and the others go on.
#[tokio::test(flavor = "multi_thread")]
async fn discovered_tenants_come_and_go_while_relayed() {
    use pgoutbox_postgres::{migrate, Outbox, Tables, TenantDiscovery};

    let pool = testing::pool(4).await.unwrap();
    let prefix = format!("disc_{}", Uuid::new_v4().simple());
    let tenant = |n: u32| Tables::in_schema(&format!("{prefix}_t{n}")).unwrap();
    let create = |tables: Tables| {
        let pool = pool.clone();
        async move { migrate(&pool, &tables).await.unwrap() }
    };
    let publish_one = |tables: Tables| {
        let pool = pool.clone();
        async move {
            let event = NewEvent::new("order", "a", "order.created", &serde_json::json!({}));
            let mut tx = pool.begin().await.unwrap();
            Outbox::new(tables).enqueue(&mut tx, &event).await.unwrap();
            tx.commit().await.unwrap();
            event.id
        }
    };
    let publisher = Arc::new(RecordingPublisher::new());
    let shown = |id: Uuid| {
        let publisher = Arc::clone(&publisher);
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !publisher.published_ids().contains(&id) {
                assert!(
                    Instant::now() < deadline,
                    "event {id} not published within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };

    create(tenant(1)).await;
    let first = publish_one(tenant(1)).await;
    let discovery = Arc::new(
        TenantDiscovery::new(
            pool.clone(),
            format!("{prefix}\\_t%"),
            Arc::clone(&publisher) as Arc<dyn DynPublisher>,
        )
        .interval(Duration::from_millis(200)),
    );
    let (stop, running) = spawn_until_stopped({
        let discovery = Arc::clone(&discovery);
        |stopped| async move { discovery.run(stopped).await }
    });
    shown(first).await;

    // A tenant created while it runs.
    create(tenant(2)).await;
    let second = publish_one(tenant(2)).await;
    shown(second).await;
    assert_eq!(
        discovery.tenants(),
        [format!("{prefix}_t1"), format!("{prefix}_t2")]
    );

    // A tenant dropped while it runs: its relay stops, the other goes on.
    sqlx::query(&format!("DROP SCHEMA {}_t1 CASCADE", prefix))
        .execute(&pool)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while discovery.tenants().len() != 1 {
        assert!(
            Instant::now() < deadline,
            "the dropped tenant is still relayed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(discovery.tenants(), [format!("{prefix}_t2")]);
    let third = publish_one(tenant(2)).await;
    shown(third).await;

    let _ = stop.send(());
    running.await.unwrap();
    assert!(discovery.tenants().is_empty());
    sqlx::query(&format!("DROP SCHEMA {}_t2 CASCADE", prefix))
        .execute(&pool)
        .await
        .unwrap();
}

/// While relays wait, the shared probe asks on one session: PL/pgSQL compiles each
/// outbox's probe function once per session, so a probe that took whichever pooled
/// connection was free (sqlx hands idle connections out in turn) paid that on
/// every connection. And a new event is still found by it.
#[tokio::test(flavor = "multi_thread")]
async fn the_shared_probe_keeps_one_session_while_relays_wait() {
    let (name, pool) = budget_pool("group_probe").await;
    // Every connection of the budget open and idle before the group starts.
    let mut open = Vec::new();
    for _ in 0..BUDGET {
        open.push(pool.acquire().await.unwrap());
    }
    drop(open);
    let observer = testing::pool(1).await.unwrap();
    let mut outboxes = Vec::new();
    let publisher = Arc::new(RecordingPublisher::new());
    let mut group = RelayGroup::new();
    for _ in 0..6 {
        let outbox = TestOutbox::with_pool(pool.clone()).await.unwrap();
        group.add(
            outbox.store(),
            Arc::clone(&publisher) as Arc<dyn DynPublisher>,
            // Nothing but the probe uses the pool once the relays wait: no claim
            // before the poll interval, no pending count after the first (six
            // counts at once would leave the probe no other connection to keep).
            RelayConfig::default()
                .poll_interval(Duration::from_secs(30))
                .pending_refresh(Duration::from_secs(3600)),
        );
        outboxes.push(outbox);
    }
    let (stop, running) = start(group);

    // Once the relays' first claims and pending counts are over (the pool's other
    // connections idle for 300 ms in a row: a busy pool makes the probe give its
    // connection back), which sessions of the pool run a probe, sampled for a
    // second of idling (the probe runs every 25 ms at most when nothing was found
    // lately).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut idle_since = Instant::now();
    while idle_since.elapsed() < Duration::from_millis(300) {
        assert!(
            Instant::now() < deadline,
            "the relays' first claims did not end"
        );
        if pool.num_idle() < BUDGET as usize - 1 {
            idle_since = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&observer)
        .await
        .unwrap();
    let mut probing = HashSet::new();
    for _ in 0..50 {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
             AND query LIKE '%probe_due%' AND query_start >= $2",
        )
        .bind(&name)
        .bind(since)
        .fetch_all(&observer)
        .await
        .unwrap();
        probing.extend(pids);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sessions: Vec<(i32, String, String)> = sqlx::query_as(
        "SELECT pid, coalesce(state, ''), left(query, 80) FROM pg_stat_activity \
         WHERE application_name = $1 ORDER BY pid",
    )
    .bind(&name)
    .fetch_all(&observer)
    .await
    .unwrap();
    assert_eq!(
        probing.len(),
        1,
        "probes ran on {} sessions of the pool; the probe keeps one (the pool's \
         sessions: {sessions:?}; idle {})",
        probing.len(),
        pool.num_idle()
    );

    let id = commit_one(&outboxes[3], "a").await;
    published_soon(&publisher, id, "an idle outbox's new").await;
    let _ = stop.send(());
    running.await.unwrap();
    for outbox in outboxes {
        outbox.drop_schema().await.unwrap();
    }
}
