//! `outbox migrate --adopt` on a database created with the seed's DDL, as a team
//! moving a live service would run it: the seed's producers keep writing with the
//! seed's statement during the adoption, then the `outbox` binary relays to NATS
//! JetStream. Every pending event arrives once per dedup id, in per-aggregate
//! insertion order, with its id and payload; processed rows are not republished;
//! rows the old relay gave up on become dead letters; a second adoption is a no-op.
#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{command, receive, run_ok, stream_consumer, Config, RelayProcess};
use pgoutbox_postgres::testing::{create_seed_outbox, pool, seed_insert};
use pgoutbox_postgres::Tables;
use uuid::Uuid;

const AGGREGATES: usize = 100;
const PENDING: usize = 10_000;
const PROCESSED: usize = 2_000;
const GIVEN_UP: usize = 50;
const PRODUCERS: usize = 4;

/// The seed's database: 10,000 pending events over 100 aggregates, written with
/// the seed's statement one transaction each (aggregates in turn, so each
/// aggregate's events have distinct `created_at`); 2,000 the old relay processed
/// (its `MarkOutboxProcessed`); 50 it gave up on (`IncrementOutboxAttempts` five
/// times), each in an aggregate of its own.
async fn seed_database(tables: &Tables) {
    use sqlx::Connection;
    let table = format!("{}.outbox_events", tables.schema().quoted());
    // A connection of its own whose 12,000 commits skip the WAL flush wait (a
    // fixture, not a producer under test).
    let mut conn = sqlx::PgConnection::connect(&pgoutbox_postgres::testing::database_url())
        .await
        .unwrap();
    sqlx::raw_sql("SET synchronous_commit = off")
        .execute(&mut conn)
        .await
        .unwrap();
    // Alone in its query: a COMMIT in a DO block needs no transaction around it.
    sqlx::raw_sql(&format!(
        "DO $$ BEGIN \
           FOR i IN 0..{processed} - 1 LOOP \
             INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'done-' || (i % 10), 'order.created', jsonb_build_object('done', i)); \
           END LOOP; \
           UPDATE {table} SET processed_at = NOW() WHERE payload ? 'done'; COMMIT; \
           FOR i IN 0..{given_up} - 1 LOOP \
             INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'poison-' || i, 'order.created', jsonb_build_object('poison', i)); \
           END LOOP; \
           FOR k IN 1..5 LOOP UPDATE {table} SET attempts = attempts + 1 WHERE payload ? 'poison'; END LOOP; \
           COMMIT; \
           FOR i IN 0..{pending} - 1 LOOP \
             INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'agg-' || (i % {aggregates}), 'order.created', \
                     jsonb_build_object('aggregate', 'agg-' || (i % {aggregates}), 'n', i)); \
             COMMIT; \
           END LOOP; \
         END $$",
        processed = PROCESSED,
        given_up = GIVEN_UP,
        pending = PENDING,
        aggregates = AGGREGATES,
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
}

/// Producers writing with the seed's statement until `stop`: producer `p` writes
/// for the aggregates `agg-k` with `k % PRODUCERS == p`, one event per
/// transaction, numbered after the seeded ones. Returns how many each wrote and
/// the longest time one INSERT took.
fn start_producers(
    pool: &sqlx::PgPool,
    tables: &Tables,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(usize, Duration)>> {
    (0..PRODUCERS)
        .map(|p| {
            let (pool, insert, stop) = (pool.clone(), seed_insert(tables.schema()), stop.clone());
            tokio::spawn(async move {
                let (mut written, mut longest) = (0, Duration::ZERO);
                let mut n = PENDING;
                while !stop.load(Ordering::Relaxed) {
                    let k = (n % AGGREGATES / PRODUCERS) * PRODUCERS + p;
                    let aggregate = format!("agg-{k}");
                    let started = Instant::now();
                    sqlx::query(&insert)
                        .bind("order")
                        .bind(&aggregate)
                        .bind("order.created")
                        .bind(serde_json::json!({ "aggregate": aggregate, "n": n }))
                        .execute(&pool)
                        .await
                        .unwrap();
                    longest = longest.max(started.elapsed());
                    written += 1;
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                (written, longest)
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn adopting_a_live_seed_outbox_publishes_every_pending_event_once_in_order() {
    let pool = pool(8).await.unwrap();
    let tables = create_seed_outbox(&pool).await.unwrap();
    let schema = tables.schema().as_str().to_owned();
    let table = format!("{}.outbox_events", tables.schema().quoted());
    seed_database(&tables).await;
    let processed: HashSet<Uuid> = sqlx::query_scalar(&format!(
        "SELECT id FROM {table} WHERE processed_at IS NOT NULL"
    ))
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(processed.len(), PROCESSED);

    let tag = Uuid::new_v4().simple().to_string()[..12].to_string();
    let stream = format!("OUTBOX_ADOPT_TEST_{tag}");
    let config = Config::with_broker(
        &schema,
        "0",
        &format!(
            "[broker]\nkind = \"nats\"\n[broker.nats]\nsubject_prefix = \"adopttest{tag}\"\n\
             ensure_stream = \"{stream}\"\n"
        ),
    );

    // The dry run says what it will do and changes nothing.
    let dry = run_ok(&config.path, &["migrate", "--adopt", "--dry-run"]);
    for needle in [
        format!("adopt {schema}.outbox_events:"),
        format!("{} pending", PENDING + GIVEN_UP),
        format!("{PROCESSED} processed"),
        format!("{GIVEN_UP} pending rows the previous relay gave up on become dead letters, in {GIVEN_UP} aggregates"),
        "drop index concurrently: idx_outbox_unprocessed".to_owned(),
        "dry run: nothing was changed".to_owned(),
    ] {
        assert!(dry.contains(&needle), "{needle:?} not in:\n{dry}");
    }
    let has_seq: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = 'outbox_events' AND column_name = 'seq')",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!has_seq, "the dry run changed the table");

    // The relay refuses a table that is not adopted yet.
    let refused = command(&config.path, &["relay"]).output().unwrap();
    assert_ne!(refused.status.code(), Some(0));

    // Adopt while the seed's producers write.
    let stop = Arc::new(AtomicBool::new(false));
    let producers = start_producers(&pool, &tables, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let adopted = run_ok(&config.path, &["migrate", "--adopt"]);
    assert!(adopted.contains("adopted:"), "{adopted}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut live = 0;
    for producer in producers {
        let (written, longest) = producer.await.unwrap();
        live += written;
        eprintln!("producer wrote {written} events; longest INSERT {longest:?}");
    }
    assert!(live > 0, "no producer wrote during the adoption");
    let again = run_ok(&config.path, &["migrate", "--adopt"]);
    assert!(again.contains("nothing to adopt"), "{again}");

    // What must arrive: every pending row as the table holds it now.
    let pending: Vec<(Uuid, String, serde_json::Value)> = sqlx::query_as(&format!(
        "SELECT id, aggregate_id, payload FROM {table} \
         WHERE processed_at IS NULL AND dead_at IS NULL ORDER BY seq"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(pending.len(), PENDING + live);
    let dead: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.outbox_dead_letters WHERE payload ? 'poison'",
        tables.schema().quoted()
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        dead, GIVEN_UP as i64,
        "the old relay's give-ups are dead letters"
    );

    let relay = RelayProcess::start(&config.path);
    let (publisher, consumer) = stream_consumer(&stream, "adopttest").await;
    let mut seen: HashSet<Uuid> = HashSet::new();
    let mut arrived: Vec<(Uuid, String, serde_json::Value)> = Vec::new();
    receive(
        &consumer,
        pending.len(),
        Duration::from_secs(120),
        |message| {
            // Deduplicated by the event id, as a consumer's inbox does.
            if seen.insert(message.id()) {
                let payload: serde_json::Value = message.decode().unwrap();
                arrived.push((message.id(), message.metadata.aggregate_id.clone(), payload));
            }
            arrived.len()
        },
    )
    .await;
    let (status, _) = relay.terminate(Duration::from_secs(25));
    assert!(status.success());
    // Nothing more: no processed row, no dead letter, nothing twice under another id.
    let late = consumer
        .fetch(100, Duration::from_millis(500))
        .await
        .unwrap();
    assert!(late
        .iter()
        .all(|m| m.as_ref().is_ok_and(|m| seen.contains(&m.id()))));
    assert!(
        arrived.iter().all(|(id, ..)| !processed.contains(id)),
        "a processed row was republished"
    );

    let expected: HashMap<Uuid, (String, serde_json::Value)> = pending
        .iter()
        .map(|(id, a, p)| (*id, (a.clone(), p.clone())))
        .collect();
    assert_eq!(arrived.len(), expected.len());
    for (id, aggregate, payload) in &arrived {
        assert_eq!(
            expected.get(id),
            Some(&(aggregate.clone(), payload.clone())),
            "event {id}"
        );
    }
    let mut order: HashMap<&str, Vec<i64>> = HashMap::new();
    for (_, aggregate, payload) in &arrived {
        order
            .entry(aggregate)
            .or_default()
            .push(payload["n"].as_i64().unwrap());
    }
    assert_eq!(order.len(), AGGREGATES);
    for (aggregate, ns) in &order {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "{aggregate}: arrived out of insertion order: {ns:?}"
        );
    }

    let client = publisher.jetstream().clone();
    client.delete_stream(&stream).await.unwrap();
    sqlx::raw_sql(&format!("DROP SCHEMA {} CASCADE", tables.schema().quoted()))
        .execute(&pool)
        .await
        .unwrap();
}
