//! The benchmark's outbox: a fresh schema, bulk filling, relays run to a count.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutbox_core::{NewEvent, Publisher, Relay, RelayConfig, Store};
use pgoutbox_postgres::{Outbox, PgStore, Tables};
use sqlx::{Connection, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::{progress, Mode, Result};

/// The schema every scenario works in; dropped and created again at the start.
pub(crate) const SCHEMA: &str = "outbox_bench";

/// The outbox under test and a pool for the benchmark's own statements.
pub(crate) struct Bench {
    pub(crate) url: String,
    pub(crate) pool: PgPool,
    pub(crate) tables: Tables,
    pub(crate) outbox: Outbox,
}

/// A pool of up to `connections` on `url`, the benchmark schema dropped; its names.
pub(crate) async fn without_schema(url: &str, connections: u32) -> Result<(PgPool, Tables)> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .connect(url)
        .await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        .execute(&pool)
        .await?;
    Ok((pool, Tables::in_schema(SCHEMA)?))
}

impl Bench {
    /// Drop and create the benchmark schema, migrated, plus a business table.
    pub(crate) async fn fresh(url: &str) -> Result<Self> {
        let (pool, tables) = without_schema(url, 24).await?;
        pgoutbox_postgres::migrate(&pool, &tables).await?;
        sqlx::query(&format!(
            "CREATE TABLE {SCHEMA}.orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             customer text NOT NULL, total bigint NOT NULL, \
             created_at timestamptz NOT NULL DEFAULT now())"
        ))
        .execute(&pool)
        .await?;
        Ok(Self {
            url: url.to_string(),
            pool,
            outbox: Outbox::new(tables.clone()),
            tables,
        })
    }

    /// Open the benchmark schema as it is (for a child process).
    pub(crate) async fn existing(url: &str) -> Result<Self> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await?;
        let tables = Tables::in_schema(SCHEMA)?;
        Ok(Self {
            url: url.to_string(),
            pool,
            outbox: Outbox::new(tables.clone()),
            tables,
        })
    }

    /// A relay store on its own pool from `relay_pool` (as a relay would have).
    pub(crate) async fn store(&self, connections: u32) -> Result<PgStore> {
        let pool =
            pgoutbox_postgres::relay_pool(&self.url, connections, Duration::from_secs(60)).await?;
        Ok(PgStore::new(pool, self.tables.clone()))
    }

    /// A relay with the default settings on a store of 3 connections waking up as
    /// `mode` says.
    pub(crate) async fn relay<P: Publisher>(
        &self,
        mode: Mode,
        publisher: P,
    ) -> Result<Relay<PgStore, P>> {
        let store = self.store(3).await?.with_wakeup(mode.wakeup());
        Ok(Relay::new(store, publisher).with_config(RelayConfig::default()))
    }

    /// Empty the tables (as [`Bench::reset`] does), then run `work` with `mode`'s
    /// set-up in place: for `notify`, its trigger, removed afterwards.
    pub(crate) async fn in_mode<T>(
        &self,
        mode: Mode,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        self.reset().await?;
        let notify = mode == Mode::Notify;
        if notify {
            pgoutbox_postgres::install_notify_trigger(&self.pool, &self.tables).await?;
        }
        let out = work.await?;
        if notify {
            pgoutbox_postgres::remove_notify_trigger(&self.pool, &self.tables).await?;
        }
        Ok(out)
    }

    /// Empty the events and business tables, then checkpoint, so runs start alike.
    pub(crate) async fn reset(&self) -> Result<()> {
        sqlx::query(&format!("TRUNCATE {SCHEMA}.outbox_events, {SCHEMA}.orders"))
            .execute(&self.pool)
            .await?;
        self.settle().await
    }

    /// Update the events table's statistics (as autovacuum would), nothing else.
    pub(crate) async fn analyze(&self) -> Result<()> {
        sqlx::query(&format!("ANALYZE {SCHEMA}.outbox_events"))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Write dirty pages out before a timed phase, so that phases start alike.
    pub(crate) async fn checkpoint(&self) -> Result<()> {
        sqlx::query("CHECKPOINT").execute(&self.pool).await?;
        Ok(())
    }

    /// Update statistics and checkpoint before a timed phase.
    pub(crate) async fn settle(&self) -> Result<()> {
        sqlx::query(&format!("VACUUM ANALYZE {SCHEMA}.outbox_events"))
            .execute(&self.pool)
            .await?;
        sqlx::query("CHECKPOINT").execute(&self.pool).await?;
        Ok(())
    }

    /// Enqueue `n` events over `aggregates` aggregates with `enqueue_many`, in
    /// transactions of 5000 events on two connections.
    pub(crate) async fn fill(&self, n: u64, aggregates: u64) -> Result<()> {
        self.fill_keys(n, &Keys::Uniform(aggregates)).await
    }

    /// Enqueue `n` events whose aggregates follow `keys`, as [`Bench::fill`] does.
    pub(crate) async fn fill_keys(&self, n: u64, keys: &Keys) -> Result<()> {
        fill_outbox(&self.url, &self.outbox, n, keys).await
    }

    /// A backlog of `n` events over `aggregates` aggregates in emptied tables,
    /// settled: [`Bench::reset`], [`Bench::fill`], [`Bench::settle`].
    pub(crate) async fn backlog(&self, n: u64, aggregates: u64) -> Result<()> {
        self.reset().await?;
        self.fill(n, aggregates).await?;
        self.settle().await
    }

    /// Insert `n` already-processed rows server-side (history for `Retention::Keep`).
    pub(crate) async fn fill_history(&self, n: u64) -> Result<()> {
        let started = Instant::now();
        let step: i64 = 1_000_000;
        let n = i64::try_from(n)?;
        let mut from = 0;
        while from < n {
            let to = (from + step).min(n);
            // Ids counting up from 0: as time-ordered as v7 ids, and distinct from them.
            sqlx::query(&format!(
                "INSERT INTO {SCHEMA}.outbox_events (id, aggregate_type, aggregate_id, event_type, \
                 payload, attempts, created_at, processed_at) \
                 SELECT lpad(to_hex(i), 32, '0')::uuid, 'order', 'a' || (i % 10000), \
                 'order.created', jsonb_build_object('n', i, 'total', i % 1000), 1, \
                 now() - interval '1 day', now() - interval '1 day' \
                 FROM generate_series($1::bigint, $2::bigint - 1) AS i"
            ))
            .bind(from)
            .bind(to)
            .execute(&self.pool)
            .await?;
            from = to;
            progress(format!("history: {to} rows"));
        }
        progress(format!(
            "inserted {n} processed rows in {:.1} s",
            started.elapsed().as_secs_f64()
        ));
        Ok(())
    }
}

/// Enqueue into `outbox` `n` events whose aggregates follow `keys`, with
/// `enqueue_many` in transactions of 5000 events on two connections.
pub(crate) async fn fill_outbox(url: &str, outbox: &Outbox, n: u64, keys: &Keys) -> Result<()> {
    let keys = Arc::new(keys.draw(n));
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let chunk = 5000;
    let fillers = (0..2).map(|_| {
        let next = Arc::clone(&next);
        let keys = Arc::clone(&keys);
        async move {
            let mut conn = PgConnection::connect(url).await?;
            loop {
                let from = next.fetch_add(chunk, Ordering::Relaxed);
                if from >= n {
                    return Ok::<_, Box<dyn std::error::Error + Send + Sync>>(());
                }
                let events: Vec<NewEvent> = (from..(from + chunk).min(n))
                    .map(|i| event_of(i, keys[i as usize]))
                    .collect();
                let mut tx = conn.begin().await?;
                outbox.enqueue_many(&mut tx, &events).await?;
                tx.commit().await?;
            }
        }
    });
    for result in futures_util::future::join_all(fillers).await {
        result?;
    }
    let elapsed = started.elapsed();
    progress(format!(
        "filled {n} events in {:.1} s ({:.0} events/s)",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64()
    ));
    Ok(())
}

/// How the events of a backlog spread over aggregates.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Keys {
    /// Event `i` belongs to aggregate `i % k`: every aggregate alike, interleaved.
    Uniform(u64),
    /// Aggregate `k` (of `keys`) drawn with probability proportional to
    /// `1 / (k + 1)^s` (a Zipf law: a few hot aggregates, a long tail), from a
    /// fixed seed so that runs compare.
    Zipf { s: f64, keys: u64 },
}

impl Keys {
    /// The aggregate number of each of `n` events.
    pub(crate) fn draw(&self, n: u64) -> Vec<u64> {
        match *self {
            Keys::Uniform(k) => (0..n).map(|i| i % k.max(1)).collect(),
            Keys::Zipf { s, keys } => {
                let mut cdf: Vec<f64> = Vec::with_capacity(keys as usize);
                let mut total = 0.0;
                for k in 0..keys.max(1) {
                    total += 1.0 / ((k + 1) as f64).powf(s);
                    cdf.push(total);
                }
                let mut rng = fastrand::Rng::with_seed(0x5eed);
                (0..n)
                    .map(|_| {
                        let u = rng.f64() * total;
                        cdf.partition_point(|&c| c < u) as u64
                    })
                    .collect()
            }
        }
    }

    /// Short name for result lines.
    pub(crate) fn describe(&self) -> String {
        match self {
            Keys::Uniform(k) => format!("{k} aggregates"),
            Keys::Zipf { s, keys } => format!("zipf s={s} over {keys} keys"),
        }
    }
}

/// The benchmark event: a small order payload, aggregates interleaved.
pub(crate) fn event(i: u64, aggregates: u64) -> NewEvent {
    event_of(i, i % aggregates.max(1))
}

/// The benchmark event number `i`, of aggregate `a{aggregate}`.
pub(crate) fn event_of(i: u64, aggregate: u64) -> NewEvent {
    let payload = format!(
        r#"{{"order_id":{i},"customer":"c{}","total_cents":{},"currency":"EUR"}}"#,
        i % 977,
        (i * 37) % 100_000
    );
    NewEvent::from_json_str("order", format!("a{aggregate}"), "order.created", payload)
}

/// Offer `total` events to `outbox` at `rate` per second, one per producer
/// transaction on `pool`, each on a task of its own so that a slow commit does not
/// slow the offer; the instant just before each event's COMMIT was sent.
pub(crate) async fn produce_at_rate(
    pool: &PgPool,
    outbox: &Outbox,
    rate: u64,
    total: u64,
) -> Result<Vec<(Uuid, Instant)>> {
    let committed: Arc<std::sync::Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        ticks.tick().await;
        let (pool, outbox) = (pool.clone(), outbox.clone());
        let committed = Arc::clone(&committed);
        tasks.spawn(async move {
            let mut tx = pool.begin().await?;
            let id = outbox.enqueue(&mut tx, &event(i, 10_000)).await?;
            // The latency clock starts just before COMMIT is sent
            // (`crate::stats::latency_millis`), in every mode alike.
            let stamped = Instant::now();
            tx.commit().await?;
            if let Ok(mut c) = committed.lock() {
                c.push((id, stamped));
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let stamps = committed.lock().map(|c| c.clone()).unwrap_or_default();
    Ok(stamps)
}

/// Run `relay` while `work` runs, then stop it; what `work` returned.
pub(crate) async fn run_while<S: Store, P: Publisher, T>(
    relay: &Relay<S, P>,
    work: impl Future<Output = T>,
) -> T {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (out, ()) = tokio::join!(
        async {
            let out = work.await;
            let _ = stop_tx.send(());
            out
        },
        relay.run(async {
            let _ = stop_rx.await;
        })
    );
    out
}

/// Run `relays` relays until together they published `n` events; the elapsed time.
/// A store error, or no end within a generous limit (60 s + 1 s per 2,000 events),
/// fails the run instead of letting it hang.
pub(crate) async fn run_relays<P: Publisher + Clone + 'static>(
    store: &PgStore,
    publisher: P,
    relays: usize,
    config: &RelayConfig,
    n: u64,
) -> Result<Duration> {
    let relays: Vec<_> = (0..relays.max(1))
        .map(|_| Relay::new(store.another_relay(), publisher.clone()).with_config(config.clone()))
        .collect();
    let stats: Vec<_> = relays.iter().map(Relay::stats).collect();
    let limit = Duration::from_secs(60 + n / 2000);
    warm(store.pool(), relays.len() as u32 + 1).await?;
    let started = Instant::now();
    let outcome = Arc::new(std::sync::Mutex::new(None::<Result<Duration, String>>));
    let done = {
        let outcome = Arc::clone(&outcome);
        async move {
            let result = loop {
                let snapshots: Vec<_> = stats.iter().map(|s| s.snapshot()).collect();
                if snapshots.iter().map(|s| s.published).sum::<u64>() >= n {
                    break Ok(started.elapsed());
                }
                let errors: u64 = snapshots.iter().map(|s| s.store_errors).sum();
                if errors > 0 {
                    break Err(format!("the relays hit {errors} store error(s)"));
                }
                if started.elapsed() > limit {
                    break Err(format!("{n} events not published within {limit:?}"));
                }
                // Coarse on purpose: waking often would take CPU from the relay.
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            if let Ok(mut o) = outcome.lock() {
                *o = Some(result);
            }
        }
    };
    let done = futures_util::FutureExt::shared(Box::pin(done));
    // A task per relay, as relay processes are: each runs on whichever runtime
    // thread is free, instead of all taking turns in one task.
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|relay| {
            let done = done.clone();
            tokio::spawn(async move { relay.run(done).await })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    let result = outcome.lock().ok().and_then(|mut o| o.take());
    match result {
        Some(Ok(elapsed)) => Ok(elapsed),
        Some(Err(error)) => Err(error.into()),
        None => Err("the relays stopped without an outcome".into()),
    }
}

/// Open `connections` connections of `pool` (and leave them idle in it), so that a
/// timed phase does not pay for connecting.
pub(crate) async fn warm(pool: &PgPool, connections: u32) -> Result<()> {
    let connections = connections.min(pool.options().get_max_connections());
    let mut held = Vec::with_capacity(connections as usize);
    for _ in 0..connections {
        held.push(pool.acquire().await?);
    }
    Ok(())
}

/// The same SQL work as the relay without it: `loops` connections each running
/// BEGIN; claim (one statement, or the store's own ordered claim); record the
/// published ids; COMMIT, until `n` events are recorded. Connections are opened
/// before the clock starts; the elapsed time of the work.
pub(crate) async fn run_sql_limit(
    url: &str,
    store: &PgStore,
    loops: usize,
    batch: usize,
    n: u64,
) -> Result<Duration> {
    let done = Arc::new(AtomicU64::new(0));
    let batch = i64::try_from(batch)?;
    // Connections open before the clock starts, as the relays' pools are warmed
    // in `run_relays`: the limit pays what the relay pays, no more.
    let mut conns = Vec::with_capacity(loops.max(1));
    for _ in 0..loops.max(1) {
        conns.push(PgConnection::connect(url).await?);
    }
    let started = Instant::now();
    // A task per loop, like the relays in `run_relays`.
    let workers: Vec<_> = conns
        .into_iter()
        .map(|mut conn| {
            let done = Arc::clone(&done);
            // A relay of its own, as the loop stands for one.
            let store = store.another_relay();
            tokio::spawn(async move {
                let sql = store.claim_and_record_sql();
                while done.load(Ordering::Relaxed) < n {
                    let mut tx = sqlx::Connection::begin_with(&mut conn, sql.begin).await?;
                    let ids: Vec<Uuid> = if sql.ordered {
                        store
                            .claim_ordered_on(&mut tx, batch)
                            .await?
                            .iter()
                            .map(|e| e.id)
                            .collect()
                    } else {
                        // The whole index: the drain starts on a table vacuum has
                        // cleaned, where relays too start from its beginning.
                        sqlx::query(sql.claim_unordered)
                            .bind(batch)
                            .bind(i64::MIN)
                            .fetch_all(&mut *tx)
                            .await?
                            .iter()
                            .map(|row| row.try_get::<Uuid, _>("id"))
                            .collect::<Result<_, _>>()?
                    };
                    if !ids.is_empty() {
                        sqlx::query(sql.record).bind(&ids).execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    done.fetch_add(ids.len() as u64, Ordering::Relaxed);
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    Ok(started.elapsed())
}

/// A JetStream publisher to `url` with subjects under `prefix`, into the stream
/// `stream` created empty (what an earlier run left deleted).
#[cfg(feature = "nats")]
pub(crate) async fn fresh_stream(
    url: &str,
    prefix: &str,
    stream: &str,
) -> Result<pgoutbox_nats::NatsPublisher> {
    use pgoutbox_nats::{NatsConfig, SubjectRouting};
    let publisher = NatsConfig::new(url)
        .routing(SubjectRouting::new(prefix))
        .build()
        .await?;
    let _ = publisher.jetstream().delete_stream(stream).await;
    publisher
        .ensure_stream(publisher.stream_config(stream))
        .await?;
    Ok(publisher)
}

/// Whether the store has nothing left to publish.
pub(crate) async fn is_drained(store: &PgStore) -> bool {
    store.pending().await.map(|n| n == 0).unwrap_or(false)
}
