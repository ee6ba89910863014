//! WAL mode against table mode, in one run: producer throughput with the relay
//! running, commit-to-publish latency at a fixed rate, and the drain of a backlog
//! written while the relay was stopped. The publisher notes when each event was
//! acknowledged: a null one by default, NATS JetStream with `--nats` (PubAck) for
//! the latency and drain phases.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{DynPublisher, NullPublisher, Publisher, Relay, RelayConfig, Store};
use pgoutbox_postgres::wal::{slot, WalOutbox, WalSource, WalStore};
use pgoutbox_postgres::Ident;
use serde_json::json;
use uuid::Uuid;

use crate::db::{event, produce_at_rate, run_while, Bench};
use crate::latency::{commit_to_publish_millis, Stamping};
use crate::produce::{write_for, Work};
use crate::stats::percentile;
use crate::{progress, verdict, Mode, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct WalArgs {
    /// Concurrent producer connections for the throughput phase.
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Measured seconds of the throughput phases (after one second of warm-up).
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
    /// Offered rate of the latency phase, events per second.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of the latency phase per mode.
    #[arg(long, default_value_t = 20)]
    latency_secs: u64,
    /// Backlog drained per mode.
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Publish the latency and drain phases to NATS JetStream at this URL (stream
    /// `OUTBOX_BENCH_WAL`, deleted afterwards; needs the `nats` feature) instead of
    /// the null publisher.
    #[arg(long)]
    nats: Option<String>,
}

/// The slot of the benchmark's WAL outbox.
pub(crate) const SLOT: &str = "outbox_bench_wal";

/// The publisher of the latency and drain phases: NATS JetStream or a null one.
async fn broker(nats: Option<&str>) -> Result<Arc<dyn DynPublisher>> {
    let Some(url) = nats else {
        return Ok(Arc::new(NullPublisher));
    };
    #[cfg(feature = "nats")]
    {
        let publisher = crate::db::fresh_stream(url, "outboxbenchwal", NATS_STREAM).await?;
        Ok(Arc::new(publisher))
    }
    #[cfg(not(feature = "nats"))]
    Err(format!("--nats {url}: built without the `nats` feature (run with --features nats)").into())
}

/// The stream `--nats` publishes into.
#[cfg(feature = "nats")]
const NATS_STREAM: &str = "OUTBOX_BENCH_WAL";

/// The two relays under test, each with its own stamping publisher.
enum Under {
    Table,
    Wal,
}

impl Under {
    fn name(&self) -> &'static str {
        match self {
            Under::Table => "table",
            Under::Wal => "wal",
        }
    }
}

/// Drop the benchmark's slot, if any: the previous phase's reader lets go of it
/// shortly after it stopped.
pub(crate) async fn drop_slot(bench: &Bench) -> Result<Ident> {
    let name = Ident::new("slot", SLOT)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(error) = slot::drop(&bench.pool, &name, &name).await {
        if Instant::now() > deadline {
            return Err(error.into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(name)
}

/// The benchmark's WAL producer on `conn`'s database, for its slot (which must
/// exist: [`fresh_slot`]).
pub(crate) async fn producer(conn: &mut sqlx::PgConnection, bench: &Bench) -> Result<WalOutbox> {
    let slot = Ident::new("slot", SLOT)?;
    Ok(WalOutbox::connect_to_slot(conn, &bench.tables, &slot).await?)
}

/// A fresh slot for the benchmark's outbox (a leftover of an earlier run dropped).
pub(crate) async fn fresh_slot(bench: &Bench) -> Result<(Ident, WalSource)> {
    let name = drop_slot(bench).await?;
    slot::create(&bench.pool, &name, &name).await?;
    let mut source = WalSource::new(&bench.url, SLOT, SLOT);
    source.status_interval = Duration::from_millis(200);
    Ok((name, source))
}

/// A relay over a fresh slot of the benchmark's outbox.
async fn wal_relay<P: Publisher>(
    bench: &Bench,
    publisher: P,
    config: RelayConfig,
) -> Result<Relay<WalStore, P>> {
    let (_, source) = fresh_slot(bench).await?;
    let store = WalStore::new(bench.pool.clone(), bench.tables.clone(), source);
    Ok(Relay::new(store, publisher).with_config(config))
}

/// Offer `total` events at `rate` while `relay` runs, until all are published;
/// their commit times.
async fn offered_while<S: Store>(
    relay: &Relay<S, Stamping>,
    bench: &Bench,
    under: &Under,
    rate: u64,
    total: u64,
) -> Result<Vec<(Uuid, Instant)>> {
    let publisher = relay.publisher();
    // One event per transaction, into the table or into the WAL.
    let outbox = match under {
        Under::Table => bench.outbox.clone(),
        Under::Wal => {
            let mut conn = bench.pool.acquire().await?;
            bench
                .outbox
                .clone()
                .with_wal(producer(&mut conn, bench).await?)?
        }
    };
    run_while(relay, async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let committed = produce_at_rate(&bench.pool, &outbox, rate, total).await?;
        publisher
            .wait_for(total as usize, Duration::from_secs(30))
            .await?;
        Ok(committed)
    })
    .await
}

/// How long `relay` takes to publish `n` events.
async fn drained_by<S: Store>(relay: &Relay<S, Stamping>, n: u64) -> Result<Duration> {
    let started = Instant::now();
    let published = relay
        .publisher()
        .wait_for(n as usize, Duration::from_secs(600));
    run_while(relay, published).await?;
    Ok(started.elapsed())
}

/// p50, p99, max of commit-to-publish milliseconds.
fn percentiles(committed: &[(Uuid, Instant)], published: &Stamping) -> Result<(f64, f64, f64)> {
    let millis = commit_to_publish_millis(committed, &published.published())?;
    Ok((
        percentile(&millis, 0.5),
        percentile(&millis, 0.99),
        millis.last().copied().unwrap_or(0.0),
    ))
}

/// Write `n` events to the WAL (10,000 aggregates) in transactions of 5,000,
/// then checkpoint.
pub(crate) async fn emit_backlog(bench: &Bench, n: u64) -> Result<()> {
    let mut conn = bench.pool.acquire().await?;
    let wal = producer(&mut conn, bench).await?;
    for chunk in (0..n).collect::<Vec<_>>().chunks(5000) {
        let events: Vec<_> = chunk.iter().map(|&i| event(i, 10_000)).collect();
        wal.enqueue_many(&mut conn, &events).await?;
    }
    drop(conn);
    bench.checkpoint().await
}

pub(crate) async fn wal(url: &str, args: &WalArgs) -> Result<Report> {
    let bench = Bench::fresh(url).await?;
    slot::check_wal_level(&bench.pool).await?;
    let duration = Duration::from_secs(args.duration_secs.max(1));

    // Producer throughput, relay running.
    bench.reset().await?;
    progress("business row only");
    let baseline = write_for(&bench, args.writers, duration, Work::BusinessOnly).await?;
    bench.reset().await?;
    progress("table mode, no relay");
    let table_alone = write_for(&bench, args.writers, duration, Work::WithEvent).await?;
    bench.reset().await?;
    progress("WAL mode, no relay");
    // Producers write only while a slot can read their events: one that nobody
    // reads during these phases (dropped by the next phase's fresh one).
    fresh_slot(&bench).await?;
    let wal_alone = write_for(&bench, args.writers, duration, Work::WithWalEvent).await?;
    bench.reset().await?;
    progress("WAL mode in the commit's round trip, no relay");
    let at_commit_alone =
        write_for(&bench, args.writers, duration, Work::WithWalEventAtCommit).await?;
    bench.reset().await?;
    progress("table mode, relay running");
    let relay = bench.relay(Mode::Adaptive, Stamping::default()).await?;
    let table_rate = run_while(
        &relay,
        write_for(&bench, args.writers, duration, Work::WithEvent),
    )
    .await?;
    drop(relay);
    bench.reset().await?;
    let mut wal_rates = Vec::new();
    for work in [Work::WithWalEvent, Work::WithWalEventAtCommit] {
        bench.reset().await?;
        progress(if work == Work::WithWalEvent {
            "WAL mode, relay running"
        } else {
            "WAL mode in the commit's round trip, relay running"
        });
        let relay = wal_relay(
            &bench,
            Stamping::default(),
            RelayConfig::default().workers(1),
        )
        .await?;
        wal_rates.push(run_while(&relay, write_for(&bench, args.writers, duration, work)).await?);
        drop(relay);
    }
    let (wal_rate, at_commit_rate) = (wal_rates[0], wal_rates[1]);
    progress(format!(
        "baseline {baseline:.0} tx/s, table {table_rate:.0} ({:.2}), wal {wal_rate:.0} ({:.2}), \
         wal at commit {at_commit_rate:.0} ({:.2})",
        table_rate / baseline,
        wal_rate / baseline,
        at_commit_rate / baseline
    ));

    // Latency at a fixed rate, and the drain: through the chosen broker.
    let sink = broker(args.nats.as_deref()).await?;
    let total = args.rate * args.latency_secs.max(1);
    let mut latency = Vec::new();
    for under in [Under::Table, Under::Wal] {
        bench.reset().await?;
        progress(format!("{} mode at {} events/s", under.name(), args.rate));
        let publisher = Stamping::over(Arc::clone(&sink));
        let committed = match under {
            Under::Table => {
                let relay = bench.relay(Mode::Adaptive, publisher.clone()).await?;
                offered_while(&relay, &bench, &under, args.rate, total).await?
            }
            Under::Wal => {
                let config = RelayConfig::default().workers(1);
                let relay = wal_relay(&bench, publisher.clone(), config).await?;
                offered_while(&relay, &bench, &under, args.rate, total).await?
            }
        };
        let (p50, p99, max) = percentiles(&committed, &publisher)?;
        progress(format!(
            "{}: p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.1} ms",
            under.name()
        ));
        latency.push((under.name(), p50, p99, max));
    }

    // Drain of a backlog written while no relay ran.
    let mut drains = Vec::new();
    for under in [Under::Table, Under::Wal] {
        bench.reset().await?;
        let publisher = Stamping::over(Arc::clone(&sink));
        let seconds = match under {
            Under::Table => {
                progress(format!("table mode: {} events backlog", args.backlog));
                bench.fill(args.backlog, 10_000).await?;
                bench.settle().await?;
                let store = bench.store(3).await?;
                let relay = Relay::new(store, publisher.clone())
                    .with_config(RelayConfig::default().batch_size(1000).workers(2));
                drained_by(&relay, args.backlog).await?
            }
            Under::Wal => {
                progress(format!("WAL mode: {} events backlog", args.backlog));
                let config = RelayConfig::default().batch_size(1000).workers(1);
                let relay = wal_relay(&bench, publisher.clone(), config).await?;
                emit_backlog(&bench, args.backlog).await?;
                drained_by(&relay, args.backlog).await?
            }
        };
        let rate = args.backlog as f64 / seconds.as_secs_f64();
        progress(format!("{}: {rate:.0} events/s", under.name()));
        drains.push((under.name(), rate));
    }
    drop_slot(&bench).await?;
    #[cfg(feature = "nats")]
    if args.nats.is_some() {
        // The stream is the benchmark's own: drop what it stored.
        if let Ok(client) =
            pgoutbox_nats::async_nats::connect(args.nats.as_deref().unwrap_or_default()).await
        {
            let _ = pgoutbox_nats::async_nats::jetstream::new(client)
                .delete_stream(NATS_STREAM)
                .await;
        }
    }
    let through = if args.nats.is_some() {
        "NATS JetStream (PubAck)"
    } else {
        "a null publisher"
    };

    let (table_p99, wal_p99) = (latency[0].2, latency[1].2);
    let drain_ratio = drains[1].1 / drains[0].1;
    Ok(Report {
        line: format!(
            "wal: producers ({} writers): business only {baseline:.0} tx/s; without a relay: \
             table mode {table_alone:.0} ({:.2}), WAL mode {wal_alone:.0} ({:.2}), at commit \
             {at_commit_alone:.0} ({:.2}); relay running: table mode {table_rate:.0} ({:.2}), WAL mode \
             {wal_rate:.0} ({:.2}), at commit {at_commit_rate:.0} ({:.2}; target >= 0.9: {}); \
             through {through}: commit-to-publish at {} events/s: table p50 {:.2} ms p99 {table_p99:.2} ms, WAL p50 \
             {:.2} ms p99 {wal_p99:.2} ms (target <= 5: {}); drain of {} events: table {:.0}/s, \
             WAL {:.0}/s ({drain_ratio:.2} x; target >= 1.0: {})",
            args.writers,
            table_alone / baseline,
            wal_alone / baseline,
            at_commit_alone / baseline,
            table_rate / baseline,
            wal_rate / baseline,
            at_commit_rate / baseline,
            verdict(at_commit_rate / baseline >= 0.9),
            args.rate,
            latency[0].1,
            latency[1].1,
            verdict(wal_p99 <= 5.0),
            args.backlog,
            drains[0].1,
            drains[1].1,
            verdict(drain_ratio >= 1.0),
        ),
        json: json!({
            "scenario": "wal", "writers": args.writers, "seconds": duration.as_secs(),
            "publisher": through,
            "baseline_tx_per_s": baseline, "table_tx_per_s": table_rate, "wal_tx_per_s": wal_rate,
            "table_no_relay_tx_per_s": table_alone, "wal_no_relay_tx_per_s": wal_alone,
            "wal_at_commit_tx_per_s": at_commit_rate, "wal_at_commit_no_relay_tx_per_s": at_commit_alone,
            "table_ratio": table_rate / baseline, "wal_ratio": wal_rate / baseline,
            "wal_at_commit_ratio": at_commit_rate / baseline,
            "rate": args.rate,
            "latency_ms": latency.iter().map(|(m, p50, p99, max)| json!({
                "mode": m, "p50": p50, "p99": p99, "max": max,
            })).collect::<Vec<_>>(),
            "backlog": args.backlog,
            "drain_per_s": drains.iter().map(|(m, r)| json!({"mode": m, "events_per_s": r})).collect::<Vec<_>>(),
            "drain_ratio": drain_ratio,
        }),
    })
}
