//! Adopting a large seed-layout outbox while its producers write: how long the
//! producers' INSERTs wait during `pgoutbox_postgres::adopt`, against the same
//! producers just before it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_postgres::testing::{seed_insert, SEED_SCHEMA};
use pgoutbox_postgres::{AdoptOptions, Tables};
use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::db::SCHEMA;
use crate::{progress, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct AdoptArgs {
    /// Rows in the seed's table before the adoption.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Of them, rows still pending (the rest the old relay marked processed).
    #[arg(long, default_value_t = 50_000)]
    pending: u64,
    /// Producers writing with the seed's statement, one connection each, one
    /// event per transaction, without pause.
    #[arg(long, default_value_t = 4)]
    writers: usize,
    /// Seconds the producers write before the adoption (the baseline).
    #[arg(long, default_value_t = 5)]
    baseline_secs: u64,
}

/// INSERT latencies of the producers while `running` is set.
async fn produce(
    url: String,
    insert: String,
    writer: usize,
    running: Arc<AtomicBool>,
) -> Result<Vec<Duration>> {
    let mut conn = PgConnection::connect(&url).await?;
    let mut latencies = Vec::new();
    let mut n = 0_u64;
    while running.load(Ordering::Relaxed) {
        n += 1;
        let started = Instant::now();
        sqlx::query(&insert)
            .bind("order")
            .bind(format!("live-{writer}-{}", n % 100))
            .bind("order.created")
            .bind(json!({ "writer": writer, "n": n }))
            .execute(&mut conn)
            .await?;
        latencies.push(started.elapsed());
    }
    conn.close().await?;
    Ok(latencies)
}

/// Run the producers while `work` runs; their latencies, sorted.
async fn produced_during<F: std::future::Future<Output = Result<T>>, T>(
    url: &str,
    tables: &Tables,
    writers: usize,
    work: F,
) -> Result<(Vec<Duration>, T, Duration)> {
    let running = Arc::new(AtomicBool::new(true));
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            tokio::spawn(produce(
                url.to_owned(),
                seed_insert(tables.schema()),
                w,
                Arc::clone(&running),
            ))
        })
        .collect();
    // Every producer connected and writing before the work starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let result = work.await;
    let took = started.elapsed();
    running.store(false, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await??);
    }
    latencies.sort();
    Ok((latencies, result?, took))
}

/// The `q` quantile of sorted durations, in milliseconds (the benchmark's one
/// percentile rule, [`crate::stats::percentile`]).
fn quantile(sorted: &[Duration], q: f64) -> f64 {
    let millis: Vec<f64> = sorted.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    crate::stats::percentile(&millis, q)
}

pub(crate) async fn adopt(url: &str, args: &AdoptArgs) -> Result<Report> {
    let (pool, tables) = crate::db::without_schema(url, 4).await?;
    sqlx::raw_sql(&SEED_SCHEMA.replace("{schema}", &tables.schema().quoted()))
        .execute(&pool)
        .await?;
    progress(format!(
        "filling {} rows ({} pending)",
        args.rows, args.pending
    ));
    let processed = args.rows.saturating_sub(args.pending);
    sqlx::query(&format!(
        "INSERT INTO {SCHEMA}.outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at, processed_at) \
         SELECT 'order', 'agg-' || (i % 1000), 'order.created', jsonb_build_object('n', i, 'note', repeat('x', 100)), \
         now() - interval '1 day' + i * interval '1 millisecond', \
         CASE WHEN i <= $1 THEN now() END FROM generate_series(1, $2) i"
    ))
    .bind(i64::try_from(processed)?)
    .bind(i64::try_from(args.rows)?)
    .execute(&pool)
    .await?;
    sqlx::query(&format!("VACUUM ANALYZE {SCHEMA}.outbox_events"))
        .execute(&pool)
        .await?;

    progress(format!(
        "baseline: {} producers for {} s",
        args.writers, args.baseline_secs
    ));
    let baseline = Duration::from_secs(args.baseline_secs);
    let (before, (), _) = produced_during(url, &tables, args.writers, async {
        tokio::time::sleep(baseline).await;
        Ok(())
    })
    .await?;
    progress("adopting while the producers write");
    let (during, plan, took) = produced_during(url, &tables, args.writers, async {
        Ok(pgoutbox_postgres::adopt(&pool, &tables, &AdoptOptions::default()).await?)
    })
    .await?;
    let numbered: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {SCHEMA}.outbox_events WHERE seq > 0 AND processed_at IS NULL"
    ))
    .fetch_one(&pool)
    .await?;
    let slow = during
        .iter()
        .filter(|d| **d > Duration::from_millis(100))
        .count();
    let line = format!(
        "adopt: {rows} rows ({pending} pending at the start, {numbered} after) adopted in {secs:.1} s while {writers} producers \
         wrote {writes} events: INSERT p50/p99/max {p50:.2}/{p99:.1}/{max:.1} ms (before: {b50:.2}/{b99:.1}/{bmax:.1} ms), \
         {slow} INSERTs over 100 ms; table locked for {locks}",
        rows = args.rows,
        pending = plan.pending,
        secs = took.as_secs_f64(),
        writers = args.writers,
        writes = during.len(),
        p50 = quantile(&during, 0.5),
        p99 = quantile(&during, 0.99),
        max = quantile(&during, 1.0),
        b50 = quantile(&before, 0.5),
        b99 = quantile(&before, 0.99),
        bmax = quantile(&before, 1.0),
        locks = plan
            .exclusive_lock_held
            .iter()
            .map(|d| format!("{:.1} ms", d.as_secs_f64() * 1000.0))
            .collect::<Vec<_>>()
            .join(" + "),
    );
    let json = json!({
        "scenario": "adopt",
        "rows": args.rows,
        "pending": plan.pending,
        "pending_after": numbered,
        "adopt_secs": took.as_secs_f64(),
        "writers": args.writers,
        "writes_during": during.len(),
        "insert_ms_during": { "p50": quantile(&during, 0.5), "p99": quantile(&during, 0.99), "max": quantile(&during, 1.0) },
        "insert_ms_before": { "p50": quantile(&before, 0.5), "p99": quantile(&before, 0.99), "max": quantile(&before, 1.0) },
        "inserts_over_100ms": slow,
        "lock_held_ms": plan.exclusive_lock_held.iter().map(|d| d.as_secs_f64() * 1000.0).collect::<Vec<_>>(),
    });
    sqlx::query(&format!("DROP SCHEMA {SCHEMA} CASCADE"))
        .execute(&pool)
        .await?;
    Ok(Report { line, json })
}
