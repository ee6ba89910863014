//! Producers and relays through a real PgBouncer in `pool_mode = transaction`,
//! connected the way `database.pgbouncer = true` connects the `outbox` binary
//! (docs/operations.md, "PgBouncer"): no prepared statement cache, no startup
//! options, the adaptive wake-up (which polls with a statement; `LISTEN` would
//! need a direct session).
//!
//! PgBouncer comes from `scripts/test.sh`, which starts it with a server pool
//! smaller than the client connections below, so that one server connection
//! serves the transactions of many clients: a statement that leaves anything on
//! its server connection (a named prepared statement, a `SET`) meets the next
//! client there. `OUTBOX_PGBOUNCER_URL` names it.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{drained, event, fast_config, run_all};
use futures_util::FutureExt;
use pgoutbox_core::testing::RecordingPublisher;
use pgoutbox_core::{NewEvent, Relay};
use pgoutbox_postgres::testing::TestOutbox;
use pgoutbox_postgres::{pooler_options, DeadLetterFilter, DeadLetters, Outbox, PgStore, Wakeup};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, Row};
use uuid::Uuid;

/// Client connections of producers, one each: more than PgBouncer's server pool.
const PRODUCERS: usize = 6;
/// Aggregates each producer writes to (its own, so it alone decides their order).
const AGGREGATES_PER_PRODUCER: usize = 3;
/// Transactions per producer, each with one event per aggregate of the producer.
const TRANSACTIONS: usize = 100;
const RELAYS: usize = 2;
const WORKERS: usize = 3;

fn pgbouncer_url() -> String {
    std::env::var("OUTBOX_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6433/test".into())
}

/// What the `outbox` binary connects with under `database.pgbouncer = true`
/// (`outbox-relay/src/db.rs`): its application name, and the pooler options (no
/// statement cache, no startup options PgBouncer refuses). Producers use the same.
fn pooled_options() -> PgConnectOptions {
    pooler_options(pgbouncer_url().parse().unwrap()).application_name("outbox")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_and_two_relays_through_pgbouncer_publish_every_event_once_in_order() {
    let problems = Problems::install();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(pooled_options())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PgBouncer does not answer at {} ({e}): scripts/test.sh starts it",
                pgbouncer_url()
            )
        });
    // The schema is made through PgBouncer too: `migrate` is documented as pooler-safe.
    let db = TestOutbox::with_pool(pool).await.unwrap();

    let publisher = Arc::new(RecordingPublisher::new());
    let mut relays = Vec::new();
    for _ in 0..RELAYS {
        // Each relay has its own pool, of the binary's default size (workers + 3).
        let pool = PgPoolOptions::new()
            .max_connections(u32::try_from(WORKERS).unwrap() + 3)
            .connect_with(pooled_options())
            .await
            .unwrap();
        let store = PgStore::new(pool, db.tables.clone()).with_wakeup(Wakeup::adaptive());
        relays.push(
            Relay::new(store, Arc::clone(&publisher))
                .with_config(fast_config().workers(WORKERS).batch_size(10)),
        );
    }

    // Relays stop once every producer is done and nothing is pending.
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let watcher = db.store();
    let shutdown = async move {
        let mut done = done_rx;
        done.wait_for(|d| *d).await.unwrap();
        drained(watcher, Duration::from_secs(120)).await;
    }
    .boxed()
    .shared();
    let producers = async {
        let mut writers = Vec::new();
        for p in 0..PRODUCERS {
            let conn = PgConnection::connect_with(&pooled_options()).await.unwrap();
            writers.push(produce(p, conn, &db.outbox));
        }
        let produced = futures_util::future::join_all(writers).await;
        done_tx.send(true).unwrap();
        produced
    };
    let (produced, ()) = tokio::time::timeout(
        Duration::from_secs(240),
        futures_util::future::join(producers, run_all(&relays, shutdown)),
    )
    .await
    .expect("producers or relays did not finish within 240 s");

    // The pool was really shared: some server connection (backend pid) ran
    // transactions of two producers' client connections.
    let mut producers_of_backend: HashMap<i32, HashSet<usize>> = HashMap::new();
    for (p, produced) in produced.iter().enumerate() {
        for pid in &produced.backends {
            producers_of_backend.entry(*pid).or_default().insert(p);
        }
    }
    assert!(
        producers_of_backend.values().any(|p| p.len() > 1),
        "no server connection served two producers ({producers_of_backend:?}): \
         PgBouncer's default_pool_size must be below {PRODUCERS}"
    );

    // Every event enqueued was published, once.
    let published = publisher.published();
    let enqueued: HashSet<Uuid> = produced
        .iter()
        .flat_map(|p| p.per_aggregate.values().flatten().copied())
        .collect();
    let published_ids: Vec<Uuid> = published.iter().map(|e| e.id).collect();
    assert_eq!(
        enqueued.len(),
        PRODUCERS * AGGREGATES_PER_PRODUCER * TRANSACTIONS
    );
    assert_eq!(published_ids.len(), enqueued.len(), "duplicates or losses");
    assert_eq!(
        published_ids.iter().copied().collect::<HashSet<_>>(),
        enqueued
    );
    // In each aggregate's order of enqueueing.
    let mut order: HashMap<&str, Vec<Uuid>> = HashMap::new();
    for e in &published {
        order.entry(&e.aggregate_id).or_default().push(e.id);
    }
    for produced in &produced {
        for (aggregate, ids) in &produced.per_aggregate {
            assert_eq!(order[aggregate.as_str()], *ids, "order of {aggregate}");
        }
    }
    // No statement failed: neither in claims and records (counted by the relays)
    // nor in the wake-up probe (only logged).
    for relay in &relays {
        let stats = relay.stats().snapshot();
        assert!(stats.claims > 0, "{stats:?}");
        assert_eq!(stats.store_errors, 0, "{stats:?}");
        assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "{stats:?}");
    }
    assert_eq!(problems.take(), Vec::<String>::new());
    // The operators' reads work through PgBouncer too, and find nothing left.
    let stats = db.store().stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead_letters), (0, 0), "{stats:?}");
    let dead = DeadLetters::new(db.pool.clone(), &db.outbox);
    assert_eq!(dead.count(&DeadLetterFilter::default()).await.unwrap(), 0);
    db.drop_schema().await.unwrap();
}

/// What one producer wrote.
struct Produced {
    /// Event ids per aggregate, in the order written.
    per_aggregate: HashMap<String, Vec<Uuid>>,
    /// The backend pids its transactions ran on.
    backends: HashSet<i32>,
}

/// Write `TRANSACTIONS` transactions on one client connection, each with one event
/// per aggregate of this producer: alternately one `enqueue_many` and single
/// `enqueue`s, both statements a service uses.
async fn produce(p: usize, mut conn: PgConnection, outbox: &Outbox) -> Produced {
    let aggregates: Vec<String> = (0..AGGREGATES_PER_PRODUCER)
        .map(|a| format!("p{p}-a{a}"))
        .collect();
    let mut produced = Produced {
        per_aggregate: HashMap::new(),
        backends: HashSet::new(),
    };
    for n in 0..TRANSACTIONS {
        let events: Vec<NewEvent> = aggregates.iter().map(|a| event(a, n)).collect();
        let mut tx = conn.begin().await.unwrap();
        // Simple protocol, no statement left behind.
        let pid: i32 = sqlx::raw_sql("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap()
            .get(0);
        produced.backends.insert(pid);
        let ids = if n % 2 == 0 {
            outbox.enqueue_many(&mut tx, &events).await.unwrap()
        } else {
            let mut ids = Vec::new();
            for e in &events {
                ids.push(outbox.enqueue(&mut tx, e).await.unwrap());
            }
            ids
        };
        tx.commit().await.unwrap();
        for (aggregate, id) in aggregates.iter().zip(ids) {
            produced
                .per_aggregate
                .entry(aggregate.clone())
                .or_default()
                .push(id);
        }
    }
    produced
}

/// The warnings and errors logged while the test runs. The wake-up probe reports
/// a failed statement only this way (the relay then claims instead of waiting).
/// sqlx's reports of slow statements (target `sqlx::query`) are no failure: a
/// loaded machine may cause them.
#[derive(Clone, Default)]
struct Problems(Arc<Mutex<Vec<String>>>);

impl Problems {
    /// Collect from every thread of this test binary (it holds this one test).
    fn install() -> Self {
        let problems = Self::default();
        tracing::subscriber::set_global_default(problems.clone()).unwrap();
        problems
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl tracing::Subscriber for Problems {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN && metadata.target() != "sqlx::query"
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut text = format!(
            "{} {}:",
            event.metadata().level(),
            event.metadata().target()
        );
        event.record(
            &mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                text.push_str(&format!(" {field}={value:?}"));
            },
        );
        self.0.lock().unwrap().push(text);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}
