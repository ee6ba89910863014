//! Live traffic while another session holds a snapshot for the whole run (what
//! `pg_dump`, a long report, an idle client or a replica's `hot_standby_feedback`
//! do), against the same run without the hold: the `outbox` binary relays to
//! stdout, producers insert with plain SQL at a fixed rate, and `VACUUM` runs every
//! few seconds in both arms (autovacuum is off on the benchmark machines; with the
//! hold, vacuum removes nothing the snapshot may see). Then a backlog is drained
//! under the same conditions.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use crate::db::{Bench, SCHEMA};
use crate::stats::{latency_millis, percentile};
use crate::{progress, verdict, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct HorizonArgs {
    /// Offered rate, events per second (one event per producer transaction).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of offered load in the held arm.
    #[arg(long, default_value_t = 600)]
    duration_secs: u64,
    /// Seconds of offered load in the unheld arm (default: `--duration-secs`).
    #[arg(long)]
    baseline_secs: Option<u64>,
    /// Length of a reporting window.
    #[arg(long, default_value_t = 30)]
    window_secs: u64,
    /// Aggregates the producers' events spread over (round robin).
    #[arg(long, default_value_t = 1000)]
    aggregates: u64,
    /// `VACUUM` of the outbox's tables every this many seconds (0: never),
    /// standing in for autovacuum.
    #[arg(long, default_value_t = 10)]
    vacuum_every_secs: u64,
    /// Events of the backlog drained after the live traffic (0: no drain).
    #[arg(long, default_value_t = 50_000)]
    drain_events: u64,
    /// Rounds; each runs both arms, their order alternating from round to round.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The arms to run (`held`, `unheld`).
    #[arg(long, value_delimiter = ',', default_values = ["unheld", "held"])]
    arms: Vec<Arm>,
    /// The `outbox` binary (default: `$CARGO_TARGET_DIR/release/outbox`, else
    /// `target/release/outbox`).
    #[arg(long)]
    binary: Option<PathBuf>,
}

/// With or without a snapshot held by another session.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Arm {
    /// A `REPEATABLE READ` session holds a snapshot for the whole run.
    Held,
    /// Nothing held.
    Unheld,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::Held => "held",
            Arm::Unheld => "unheld",
        }
    }
}

/// One reporting window of a run: the events committed in it and what the
/// server looked like at its end.
#[derive(Debug, Clone)]
struct Window {
    end_secs: u64,
    p50_ms: f64,
    p99_ms: f64,
    /// p99 of the producers' own `INSERT`s (sent to committed) in the window: a
    /// stall of the server's commits shows here as well as in `p99_ms`, a stall
    /// of the relay only there.
    commit_p99_ms: f64,
    published_per_s: f64,
    backlog: u64,
    dead_tuples: i64,
    index_bytes: i64,
}

#[derive(Debug, Clone)]
struct Run {
    arm: Arm,
    p50_ms: f64,
    p99_ms: f64,
    windows: Vec<Window>,
    produced: usize,
    lost: usize,
    backlog_at_end: u64,
    drain_per_s: Option<f64>,
}

pub(crate) async fn horizon(url: &str, args: &HorizonArgs) -> Result<Report> {
    let binary = crate::live::binary(args.binary.as_ref())?;
    let mut runs: Vec<Run> = Vec::new();
    for round in 0..args.rounds.max(1) {
        let mut arms = args.arms.clone();
        if round % 2 == 1 {
            arms.reverse();
        }
        for arm in arms {
            let seconds = match arm {
                Arm::Held => args.duration_secs,
                Arm::Unheld => args.baseline_secs.unwrap_or(args.duration_secs),
            };
            progress(format!(
                "round {}: {} arm, {} events/s for {seconds} s",
                round + 1,
                arm.name(),
                args.rate
            ));
            let run = run(url, args, &binary, arm, seconds).await?;
            progress(format!(
                "{}: p50 {:.1} ms, p99 {:.1} ms, backlog at the end {}, drain {}",
                arm.name(),
                run.p50_ms,
                run.p99_ms,
                run.backlog_at_end,
                run.drain_per_s
                    .map_or("-".to_string(), |r| format!("{r:.0} events/s"))
            ));
            runs.push(run);
        }
    }
    Ok(report(args, &runs))
}

fn report(args: &HorizonArgs, runs: &[Run]) -> Report {
    let of = |arm: Arm| runs.iter().filter(move |r| r.arm == arm);
    let unheld_p99 = of(Arm::Unheld).map(|r| r.p99_ms).fold(f64::NAN, f64::max);
    let unheld_drain = of(Arm::Unheld)
        .filter_map(|r| r.drain_per_s)
        .fold(f64::NAN, f64::max);
    let mut met = true;
    let mut lines = Vec::new();
    for run in runs {
        lines.push(format!(
            "{} arm: p50 {:.1} ms, p99 {:.1} ms over {} events ({} lost), backlog when the \
             producers stopped {}, drain of {} events {}",
            run.arm.name(),
            run.p50_ms,
            run.p99_ms,
            run.produced,
            run.lost,
            run.backlog_at_end,
            args.drain_events,
            run.drain_per_s
                .map_or("-".to_string(), |r| format!("{r:.0} events/s"))
        ));
        lines.push(
            "  window end s | p50 ms | p99 ms | commit p99 ms | published/s | backlog | dead tuples \
             | index MB"
                .to_string(),
        );
        for w in &run.windows {
            lines.push(format!(
                "  {:>12} | {:>6.1} | {:>6.1} | {:>13.1} | {:>11.0} | {:>7} | {:>11} | {:>8.1}",
                w.end_secs,
                w.p50_ms,
                w.p99_ms,
                w.commit_p99_ms,
                w.published_per_s,
                w.backlog,
                w.dead_tuples,
                w.index_bytes as f64 / 1_048_576.0
            ));
        }
        if run.arm == Arm::Held {
            let worst = run.windows.iter().map(|w| w.p99_ms).fold(0.0, f64::max);
            let latency_met = unheld_p99.is_finite() && worst <= 2.0 * unheld_p99;
            let backlog_met = run.backlog_at_end < args.rate;
            let drain_ratio = run.drain_per_s.map(|d| d / unheld_drain);
            let drain_met = drain_ratio.is_none_or(|r| r >= 0.8);
            met &= latency_met && backlog_met && drain_met && run.lost == 0;
            lines.push(format!(
                "  held: worst window p99 {worst:.1} ms vs 2 x unheld p99 {:.1} ms: {}; backlog at \
                 the end {} vs < {} (1 s of traffic): {}; drain {} x unheld: {}",
                2.0 * unheld_p99,
                verdict(latency_met),
                run.backlog_at_end,
                args.rate,
                verdict(backlog_met),
                drain_ratio.map_or("-".to_string(), |r| format!("{r:.2}")),
                verdict(drain_met)
            ));
        }
    }
    Report {
        line: format!(
            "horizon: `outbox relay` (stdout broker), plain SQL inserts at {} events/s over {} \
             aggregates, VACUUM every {} s in both arms, one REPEATABLE READ snapshot held \
             for the whole held arm; commit-to-publish measured from the producer's clock \
             just before its INSERT (autocommit) to the relay's output line; targets (held): \
             every window's p99 <= 2 x the unheld p99, backlog when the producers stop < 1 s \
             of traffic, drain >= 0.8 x unheld: {}\n{}",
            args.rate,
            args.aggregates,
            args.vacuum_every_secs,
            verdict(met),
            lines.join("\n")
        ),
        json: json!({
            "scenario": "horizon", "rate": args.rate, "aggregates": args.aggregates,
            "vacuum_every_secs": args.vacuum_every_secs, "window_secs": args.window_secs,
            "runs": runs.iter().map(|r| json!({
                "arm": r.arm.name(), "p50_ms": r.p50_ms, "p99_ms": r.p99_ms,
                "produced": r.produced, "lost": r.lost, "backlog_at_end": r.backlog_at_end,
                "drain_per_s": r.drain_per_s,
                "windows": r.windows.iter().map(|w| json!({
                    "end_secs": w.end_secs, "p50_ms": w.p50_ms, "p99_ms": w.p99_ms,
                    "commit_p99_ms": w.commit_p99_ms,
                    "published_per_s": w.published_per_s, "backlog": w.backlog,
                    "dead_tuples": w.dead_tuples, "index_bytes": w.index_bytes,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "target_met": met,
        }),
    }
}

/// One produced event: its id, the instant just before its `INSERT` was sent, and
/// the instant its commit returned.
#[derive(Debug, Clone, Copy)]
struct Stamp {
    id: Uuid,
    sent: Instant,
    committed: Instant,
}

/// Arrival instants of the events the relay printed, by id.
type Arrivals = Arc<Mutex<HashMap<Uuid, Instant>>>;

/// The relay process, its output read line by line; stopped when dropped.
struct RelayProcess {
    child: std::process::Child,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl RelayProcess {
    fn start(binary: &Path, url: &str, arrivals: &Arrivals) -> Result<Self> {
        let mut child = std::process::Command::new(binary)
            .arg("relay")
            .env("OUTBOX_DATABASE_URL", url)
            .env("OUTBOX_SCHEMA", SCHEMA)
            .env("OUTBOX_BROKER", "stdout")
            .env("OUTBOX_HTTP_LISTEN", format!("127.0.0.1:{HTTP_PORT}"))
            .env_remove("OUTBOX_CONFIG")
            .env_remove("OUTBOX_LOG")
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let stdout = child.stdout.take().ok_or("the relay's stdout")?;
        let arrivals = Arc::clone(arrivals);
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let now = Instant::now();
                let id = serde_json::from_str::<serde_json::Value>(&line)
                    .ok()
                    .and_then(|v| v.get("id").and_then(|id| id.as_str()).map(str::to_owned))
                    .and_then(|id| Uuid::parse_str(&id).ok());
                if let (Some(id), Ok(mut arrivals)) = (id, arrivals.lock()) {
                    arrivals.entry(id).or_insert(now);
                }
            }
        });
        Ok(Self {
            child,
            reader: Some(reader),
        })
    }

    /// Until the relay serves HTTP (it has connected and started).
    async fn ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the relay exited at start: {status}").into());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", HTTP_PORT))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the relay did not listen on {HTTP_PORT}").into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// Port of the relay's HTTP endpoints (its readiness).
const HTTP_PORT: u16 = 19_287;

/// Server-side state at one instant: dead tuples of the events table (as the
/// statistics collector counts them) and the size of its indexes.
async fn server_state(pool: &PgPool) -> (i64, i64) {
    let dead: i64 = sqlx::query_scalar(
        "SELECT COALESCE(n_dead_tup, 0) FROM pg_stat_user_tables \
         WHERE schemaname = $1 AND relname = 'outbox_events'",
    )
    .bind(SCHEMA)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
    .unwrap_or(0);
    let index_bytes: i64 =
        sqlx::query_scalar(&format!("SELECT pg_indexes_size('{SCHEMA}.outbox_events')"))
            .fetch_one(pool)
            .await
            .unwrap_or(0);
    (dead, index_bytes)
}

/// `VACUUM` of the outbox's tables every `every` until `stop`.
fn vacuum_periodically(
    pool: PgPool,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if every.is_zero() {
            return;
        }
        let statement = format!(
            "VACUUM {SCHEMA}.outbox_events, {SCHEMA}.outbox_events_held, \
             {SCHEMA}.outbox_events_relays"
        );
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(every).await;
            if let Err(error) = sqlx::raw_sql(&statement).execute(&pool).await {
                progress(format!("VACUUM failed: {error}"));
            }
        }
    })
}

/// A session holding a snapshot until the connection is closed.
async fn hold_snapshot(url: &str) -> Result<PgConnection> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// Producers' plain SQL, as a service in any language would write an event.
fn insert_statement() -> String {
    format!(
        "INSERT INTO {SCHEMA}.outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', $2, 'order.created', $3)"
    )
}

/// Insert `rate` events a second for `seconds` (round robin over `aggregates`),
/// one autocommit `INSERT` each; each event's id, the instant just before its
/// `INSERT` was sent and the instant its commit returned, in commit order
/// (roughly).
async fn produce(pool: &PgPool, rate: u64, seconds: u64, aggregates: u64) -> Result<Vec<Stamp>> {
    let stamps: Arc<Mutex<Vec<Stamp>>> = Arc::default();
    let statement = Arc::new(insert_statement());
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..rate * seconds {
        ticks.tick().await;
        let (pool, stamps, statement) = (pool.clone(), Arc::clone(&stamps), Arc::clone(&statement));
        tasks.spawn(async move {
            let id = Uuid::now_v7();
            let sent = Instant::now();
            sqlx::query(&statement)
                .bind(id)
                .bind((i % aggregates).to_string())
                .bind(serde_json::json!({ "n": i }))
                .execute(&pool)
                .await?;
            let committed = Instant::now();
            if let Ok(mut stamps) = stamps.lock() {
                stamps.push(Stamp {
                    id,
                    sent,
                    committed,
                });
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
    let stamps = stamps.lock().map(|s| s.clone()).unwrap_or_default();
    Ok(stamps)
}

async fn run(url: &str, args: &HorizonArgs, binary: &Path, arm: Arm, seconds: u64) -> Result<Run> {
    let bench = Bench::fresh(url).await?;
    bench.analyze().await?;
    bench.checkpoint().await?;
    let producers = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await?;
    let holder = match arm {
        Arm::Held => Some(hold_snapshot(url).await?),
        Arm::Unheld => None,
    };
    let arrivals: Arrivals = Arc::default();
    let mut relay = RelayProcess::start(binary, url, &arrivals)?;
    relay.ready().await?;
    let stop = Arc::new(AtomicBool::new(false));
    let vacuum = vacuum_periodically(
        bench.pool.clone(),
        Duration::from_secs(args.vacuum_every_secs),
        Arc::clone(&stop),
    );
    // Server state at the end of every window.
    let window = Duration::from_secs(args.window_secs.max(1));
    let sampler = {
        let (pool, stop) = (bench.pool.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut states = Vec::new();
            let started = Instant::now();
            let mut next = started + window;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(next.into()).await;
                states.push((next, server_state(&pool).await));
                next += window;
            }
            states
        })
    };
    let started = Instant::now();
    let stamps = produce(&producers, args.rate, seconds, args.aggregates).await?;
    let stopped = Instant::now();
    let arrived_at_stop = arrivals.lock().map(|a| a.len()).unwrap_or(0);
    let backlog_at_end = stamps.len().saturating_sub(arrived_at_stop) as u64;
    // The rest arrives (at most 120 s).
    let deadline = Instant::now() + Duration::from_secs(120);
    while arrivals.lock().map(|a| a.len()).unwrap_or(0) < stamps.len() && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let states = sampler.await.map_err(|e| format!("sampler: {e}"))?;
    let arrivals_now = arrivals.lock().map(|a| a.clone()).unwrap_or_default();

    let latency = |s: &Stamp| {
        arrivals_now
            .get(&s.id)
            .map(|at| latency_millis(s.sent, *at))
    };
    let mut all: Vec<f64> = stamps.iter().filter_map(latency).collect();
    all.sort_by(f64::total_cmp);
    let lost = stamps.len() - all.len();
    let mut windows = Vec::new();
    let total = stopped.saturating_duration_since(started);
    let count = (total.as_secs_f64() / window.as_secs_f64()).ceil() as u64;
    for k in 0..count {
        let (from, to) = (
            started + window * k as u32,
            started + window * (k as u32 + 1),
        );
        let in_window = || stamps.iter().filter(|s| s.sent >= from && s.sent < to);
        let mut ms: Vec<f64> = in_window().filter_map(latency).collect();
        ms.sort_by(f64::total_cmp);
        let mut commit_ms: Vec<f64> = in_window()
            .map(|s| latency_millis(s.sent, s.committed))
            .collect();
        commit_ms.sort_by(f64::total_cmp);
        let published = arrivals_now
            .values()
            .filter(|at| **at >= from && **at < to)
            .count();
        let produced_by = stamps.iter().filter(|s| s.sent < to).count();
        let arrived_by = arrivals_now.values().filter(|at| **at < to).count();
        let (dead_tuples, index_bytes) = states
            .iter()
            .find(|(at, _)| *at >= to)
            .map_or((0, 0), |(_, state)| *state);
        windows.push(Window {
            end_secs: (k + 1) * window.as_secs(),
            p50_ms: percentile(&ms, 0.50),
            p99_ms: percentile(&ms, 0.99),
            commit_p99_ms: percentile(&commit_ms, 0.99),
            published_per_s: published as f64 / window.as_secs_f64(),
            backlog: produced_by.saturating_sub(arrived_by) as u64,
            dead_tuples,
            index_bytes,
        });
    }

    // A backlog drained under the same conditions: the relay stopped, the events
    // committed, a relay started again; from its first output line to its last.
    let drain_per_s = if args.drain_events > 0 {
        drop(relay);
        let stop_drain = Arc::new(AtomicBool::new(false));
        let vacuum_drain = vacuum_periodically(
            bench.pool.clone(),
            Duration::from_secs(args.vacuum_every_secs),
            Arc::clone(&stop_drain),
        );
        bench.fill(args.drain_events, args.aggregates).await?;
        let drained: Arrivals = Arc::default();
        let mut relay = RelayProcess::start(binary, url, &drained)?;
        relay.ready().await?;
        let deadline = Instant::now() + Duration::from_secs(600);
        while drained.lock().map(|a| a.len()).unwrap_or(0) < args.drain_events as usize
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(relay);
        stop_drain.store(true, Ordering::Relaxed);
        let _ = vacuum_drain.await;
        let drained = drained.lock().map(|a| a.clone()).unwrap_or_default();
        let first = drained.values().min().copied();
        let last = drained.values().max().copied();
        match (first, last) {
            (Some(first), Some(last)) if drained.len() as u64 >= args.drain_events => {
                Some(drained.len() as f64 / last.duration_since(first).as_secs_f64().max(1e-3))
            }
            _ => None,
        }
    } else {
        drop(relay);
        None
    };
    let _ = vacuum.await;
    drop(holder);
    Ok(Run {
        arm,
        p50_ms: percentile(&all, 0.50),
        p99_ms: percentile(&all, 0.99),
        windows,
        produced: stamps.len(),
        lost,
        backlog_at_end,
        drain_per_s,
    })
}
