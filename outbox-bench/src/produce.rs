//! Producer throughput: business transactions with and without an outbox event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::NullPublisher;
use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::db::{event, run_while, Bench};
use crate::{progress, verdict, Mode, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct ProduceArgs {
    /// Concurrent writers, one connection each.
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Measured seconds per mode (after one second of warm-up).
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
    /// Wake-up modes to measure (a relay with this mode drains while producers write).
    #[arg(long, value_delimiter = ',', default_values = ["fixed", "adaptive", "notify"])]
    modes: Vec<Mode>,
}

/// What the writers commit.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    BusinessOnly,
    WithEvent,
    /// Control: a second business row instead of the event (same statement count).
    TwoBusinessRows,
    /// The event written to the WAL (`WalOutbox`) instead of the outbox table.
    WithWalEvent,
    /// The event written to the WAL in the commit's round trip (`WalOutbox::commit`).
    WithWalEventAtCommit,
}

/// Commit transactions on `writers` connections for `duration`; transactions per second.
pub(crate) async fn write_for(
    bench: &Bench,
    writers: usize,
    duration: Duration,
    work: Work,
) -> Result<f64> {
    let counted = Arc::new(AtomicU64::new(0));
    let warmup = Duration::from_secs(1);
    let started = Instant::now();
    let (from, to) = (started + warmup, started + warmup + duration);
    let tasks = (0..writers.max(1)).map(|w| {
        let counted = Arc::clone(&counted);
        async move {
            let mut conn = PgConnection::connect(&bench.url).await?;
            let insert = format!(
                "INSERT INTO {}.orders (customer, total) VALUES ($1, $2)",
                crate::db::SCHEMA
            );
            // WAL work writes for the benchmark's slot, which the caller made.
            let wal = match work {
                Work::WithWalEvent | Work::WithWalEventAtCommit => {
                    Some(crate::wal::producer(&mut conn, bench).await?)
                }
                _ => None,
            };
            let mut i = w as u64 * 1_000_000_000;
            loop {
                let now = Instant::now();
                if now >= to {
                    return Ok::<_, Box<dyn std::error::Error + Send + Sync>>(());
                }
                i += 1;
                let mut tx = conn.begin().await?;
                sqlx::query(&insert)
                    .bind(format!("c{}", i % 977))
                    .bind(i64::try_from(i % 100_000)?)
                    .execute(&mut *tx)
                    .await?;
                match work {
                    Work::BusinessOnly | Work::WithWalEventAtCommit => {}
                    Work::WithEvent => {
                        bench.outbox.enqueue(&mut tx, &event(i, 10_000)).await?;
                    }
                    Work::WithWalEvent => {
                        let wal = wal.as_ref().ok_or("no WAL outbox")?;
                        wal.enqueue(&mut tx, &event(i, 10_000)).await?;
                    }
                    Work::TwoBusinessRows => {
                        sqlx::query(&insert)
                            .bind(format!("d{}", i % 977))
                            .bind(i64::try_from(i % 100_000)?)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
                if work == Work::WithWalEventAtCommit {
                    let wal = wal.as_ref().ok_or("no WAL outbox")?;
                    wal.commit(tx, &[event(i, 10_000)]).await?;
                } else {
                    tx.commit().await?;
                }
                let done = Instant::now();
                if done >= from && done < to {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    for result in futures_util::future::join_all(tasks).await {
        result?;
    }
    Ok(counted.load(Ordering::Relaxed) as f64 / duration.as_secs_f64())
}

/// Producer transactions per second with the outbox (per wake-up mode, relay
/// running) against the same transactions without the event.
pub(crate) async fn produce(url: &str, args: &ProduceArgs) -> Result<Report> {
    let bench = Bench::fresh(url).await?;
    let duration = Duration::from_secs(args.duration_secs.max(1));

    bench.reset().await?;
    progress("business row only");
    let baseline = write_for(&bench, args.writers, duration, Work::BusinessOnly).await?;
    progress(format!("baseline {baseline:.0} tx/s"));

    bench.reset().await?;
    progress("control: two business rows");
    let control = write_for(&bench, args.writers, duration, Work::TwoBusinessRows).await?;
    progress(format!("control {control:.0} tx/s"));

    bench.reset().await?;
    progress("business row + event, no relay");
    let no_relay = write_for(&bench, args.writers, duration, Work::WithEvent).await?;
    progress(format!("no relay {no_relay:.0} tx/s"));

    let mut results = Vec::new();
    for &mode in &args.modes {
        let rate = bench
            .in_mode(mode, async {
                let relay = bench.relay(mode, NullPublisher).await?;
                progress(format!("business row + event, relay with {}", mode.name()));
                let writes = write_for(&bench, args.writers, duration, Work::WithEvent);
                run_while(&relay, writes).await
            })
            .await?;
        progress(format!("{}: {rate:.0} tx/s", mode.name()));
        results.push((mode, rate));
    }

    let default_ratio = results
        .iter()
        .find(|(m, _)| *m == Mode::Adaptive)
        .map(|(_, r)| r / baseline);
    let parts: Vec<String> = results
        .iter()
        .map(|(m, r)| format!("{} {r:.0} tx/s ({:.2})", m.name(), r / baseline))
        .collect();
    let target = match default_ratio {
        Some(ratio) => format!(
            "default (adaptive-poll) ratio {ratio:.2}, target >= 0.9: {}",
            verdict(ratio >= 0.9)
        ),
        None => "default mode not measured".to_string(),
    };
    Ok(Report {
        line: format!(
            "produce: {} writers, business only {baseline:.0} tx/s; control, two business \
             rows {control:.0} tx/s ({:.2}); with event: no relay {no_relay:.0} tx/s ({:.2}), \
             {}; {target}",
            args.writers,
            control / baseline,
            no_relay / baseline,
            parts.join(", ")
        ),
        json: json!({
            "scenario": "produce", "writers": args.writers, "seconds": duration.as_secs(),
            "baseline_tx_per_s": baseline, "control_two_rows_tx_per_s": control,
            "no_relay_tx_per_s": no_relay,
            "modes": results.iter().map(|(m, r)| json!({
                "mode": m.name(), "tx_per_s": r, "ratio": r / baseline,
            })).collect::<Vec<_>>(),
            "default_ratio": default_ratio,
            "target_met": default_ratio.map(|r| r >= 0.9),
        }),
    })
}
