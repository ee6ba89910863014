//! Live traffic while another session holds a snapshot for the whole run (what
//! `pg_dump`, a long report, an idle client or a replica's `hot_standby_feedback`
//! do), against the same run without the hold: the `outbox` binary relays to
//! stdout, producers insert with plain SQL at a fixed rate, and `VACUUM` runs every
//! few seconds in both arms (autovacuum is off on the benchmark machines; with the
//! hold, vacuum removes nothing the snapshot may see). Then backlogs are drained
//! under the same conditions. The arms run one after the other, or, with
//! `--side-by-side`, at the same time in two databases: a snapshot holds back
//! vacuum only in its own database, so the unheld arm meets the same host and
//! server stalls as the held one without its hold.

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
use crate::machine::CpuTimes;
use crate::stats::{latency_millis, median, percentile};
use crate::{progress, verdict, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct HorizonArgs {
    /// Offered rate, events per second (one event per producer transaction).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of offered load in the held arm.
    #[arg(long, default_value_t = 600)]
    duration_secs: u64,
    /// Seconds of offered load in the unheld arm (default: `--duration-secs`;
    /// ignored with `--side-by-side`).
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
    /// Events of each backlog drained after the live traffic (0: no drain).
    #[arg(long, default_value_t = 50_000)]
    drain_events: u64,
    /// Backlogs drained one after the other in each arm; the median counts (a
    /// drain lasts about a second, and a VACUUM or a host stall falling into it
    /// moves that one by a quarter).
    #[arg(long, default_value_t = 3)]
    drains: usize,
    /// Rounds; each runs both arms, their order alternating from round to round.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The arms to run (`held`, `unheld`; both with `--side-by-side`).
    #[arg(long, value_delimiter = ',', default_values = ["unheld", "held"])]
    arms: Vec<Arm>,
    /// Run the unheld arm at the same time as the held one, for `--duration-secs`
    /// each, in a second database (the URL's with `_unheld` appended, created when
    /// missing; a snapshot holds back vacuum in its own database only), each arm
    /// with its own relay, producers and VACUUM: both meet the same host stalls
    /// window by window, which a long held arm against a short baseline does not.
    /// The drains then alternate between the arms.
    #[arg(long)]
    side_by_side: bool,
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

    /// Port of this arm's relay's HTTP endpoints (its readiness): two relays run
    /// at once side by side.
    fn http_port(self) -> u16 {
        match self {
            Arm::Held => 19_287,
            Arm::Unheld => 19_288,
        }
    }
}

/// One reporting window of a run: the events committed in it and what the
/// server and the machine looked like in it.
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
    /// Seconds of the window in which this arm's `VACUUM` ran.
    vacuum_secs: f64,
    /// Shares of the machine's CPU time in the window stolen by the host and idle
    /// waiting for I/O (`None` off Linux).
    steal: Option<f64>,
    iowait: Option<f64>,
}

/// One drained backlog: its rate, and how much of it a `VACUUM` overlapped.
#[derive(Debug, Clone, Copy)]
struct Drain {
    per_s: f64,
    vacuum_secs: f64,
}

#[derive(Debug, Clone)]
struct Run {
    arm: Arm,
    database: String,
    p50_ms: f64,
    p99_ms: f64,
    windows: Vec<Window>,
    produced: usize,
    lost: usize,
    backlog_at_end: u64,
    drains: Vec<Drain>,
}

impl Run {
    /// The median drain rate (`None` without drains).
    fn drain_per_s(&self) -> Option<f64> {
        let rates: Vec<f64> = self.drains.iter().map(|d| d.per_s).collect();
        (!rates.is_empty()).then(|| median(&rates))
    }
}

pub(crate) async fn horizon(url: &str, args: &HorizonArgs) -> Result<Report> {
    let binary = crate::live::binary(args.binary.as_ref())?;
    let unheld_url = match args.side_by_side {
        true => Some(sibling_database(url, "unheld").await?),
        false => None,
    };
    let mut runs: Vec<Run> = Vec::new();
    for round in 0..args.rounds.max(1) {
        if let Some(unheld_url) = &unheld_url {
            progress(format!(
                "round {}: held and unheld arms side by side, {} events/s for {} s each",
                round + 1,
                args.rate,
                args.duration_secs
            ));
            let (held, unheld) = tokio::try_join!(
                traffic(url, args, &binary, Arm::Held, args.duration_secs),
                traffic(unheld_url, args, &binary, Arm::Unheld, args.duration_secs),
            )?;
            let mut arms = [held, unheld];
            if round % 2 == 1 {
                arms.reverse();
            }
            for _ in 0..args.drains {
                for arm in &mut arms {
                    arm.drain(args, &binary).await?;
                }
                arms.reverse();
            }
            for arm in arms {
                runs.push(arm.finish());
            }
            continue;
        }
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
            let mut traffic = traffic(url, args, &binary, arm, seconds).await?;
            for _ in 0..args.drains {
                traffic.drain(args, &binary).await?;
            }
            runs.push(traffic.finish());
        }
    }
    for run in &runs {
        progress(format!(
            "{} arm: p50 {:.1} ms, p99 {:.1} ms, backlog at the end {}, drain {}",
            run.arm.name(),
            run.p50_ms,
            run.p99_ms,
            run.backlog_at_end,
            run.drain_per_s()
                .map_or("-".to_string(), |r| format!("{r:.0} events/s"))
        ));
    }
    Ok(report(args, &runs))
}

fn report(args: &HorizonArgs, runs: &[Run]) -> Report {
    let of = |arm: Arm| runs.iter().filter(move |r| r.arm == arm);
    let unheld_p99 = of(Arm::Unheld).map(|r| r.p99_ms).fold(f64::NAN, f64::max);
    let unheld_drain = of(Arm::Unheld)
        .filter_map(Run::drain_per_s)
        .fold(f64::NAN, f64::max);
    let percent =
        |share: Option<f64>| share.map_or("-".to_string(), |s| format!("{:.0}", s * 100.0));
    let mut met = true;
    let mut lines = Vec::new();
    for run in runs {
        lines.push(format!(
            "{} arm (database {}): p50 {:.1} ms, p99 {:.1} ms over {} events ({} lost), backlog \
             when the producers stopped {}, drains of {} events: {} (median {})",
            run.arm.name(),
            run.database,
            run.p50_ms,
            run.p99_ms,
            run.produced,
            run.lost,
            run.backlog_at_end,
            args.drain_events,
            run.drains
                .iter()
                .map(|d| format!("{:.0}/s (VACUUM {:.1} s of it)", d.per_s, d.vacuum_secs))
                .collect::<Vec<_>>()
                .join(", "),
            run.drain_per_s()
                .map_or("-".to_string(), |r| format!("{r:.0} events/s"))
        ));
        lines.push(
            "  window end s | p50 ms | p99 ms | commit p99 ms | published/s | backlog | dead tuples \
             | index MB | VACUUM s | steal % | iowait %"
                .to_string(),
        );
        for w in &run.windows {
            lines.push(format!(
                "  {:>12} | {:>6.1} | {:>6.1} | {:>13.1} | {:>11.0} | {:>7} | {:>11} | {:>8.1} | \
                 {:>8.1} | {:>7} | {:>8}",
                w.end_secs,
                w.p50_ms,
                w.p99_ms,
                w.commit_p99_ms,
                w.published_per_s,
                w.backlog,
                w.dead_tuples,
                w.index_bytes as f64 / 1_048_576.0,
                w.vacuum_secs,
                percent(w.steal),
                percent(w.iowait)
            ));
        }
        if run.arm == Arm::Held {
            let worst = run.windows.iter().map(|w| w.p99_ms).fold(0.0, f64::max);
            let above = run
                .windows
                .iter()
                .filter(|w| w.p99_ms > 2.0 * unheld_p99)
                .count();
            let latency_met = unheld_p99.is_finite() && worst <= 2.0 * unheld_p99;
            let backlog_met = run.backlog_at_end < args.rate;
            let drain_ratio = run.drain_per_s().map(|d| d / unheld_drain);
            let drain_met = drain_ratio.is_none_or(|r| r >= 0.8);
            met &= latency_met && backlog_met && drain_met && run.lost == 0;
            lines.push(format!(
                "  held: worst window p99 {worst:.1} ms vs 2 x unheld p99 {:.1} ms ({above} of {} \
                 windows above): {}; backlog at the end {} vs < {} (1 s of traffic): {}; median \
                 drain {} x unheld: {}",
                2.0 * unheld_p99,
                run.windows.len(),
                verdict(latency_met),
                run.backlog_at_end,
                args.rate,
                verdict(backlog_met),
                drain_ratio.map_or("-".to_string(), |r| format!("{r:.2}")),
                verdict(drain_met)
            ));
        }
    }
    let arms = match args.side_by_side {
        true => "both arms at once in two databases",
        false => "arms one after the other",
    };
    Report {
        line: format!(
            "horizon: `outbox relay` (stdout broker), plain SQL inserts at {} events/s over {} \
             aggregates, VACUUM every {} s in both arms, one REPEATABLE READ snapshot held \
             for the whole held arm, {arms}; commit-to-publish measured from the producer's \
             clock just before its INSERT (autocommit) to the relay's output line; targets \
             (held): every window's p99 <= 2 x the unheld p99, backlog when the producers stop \
             < 1 s of traffic, median drain >= 0.8 x unheld: {}\n{}",
            args.rate,
            args.aggregates,
            args.vacuum_every_secs,
            verdict(met),
            lines.join("\n")
        ),
        json: json!({
            "scenario": "horizon", "rate": args.rate, "aggregates": args.aggregates,
            "vacuum_every_secs": args.vacuum_every_secs, "window_secs": args.window_secs,
            "side_by_side": args.side_by_side,
            "runs": runs.iter().map(|r| json!({
                "arm": r.arm.name(), "database": r.database, "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms, "produced": r.produced, "lost": r.lost,
                "backlog_at_end": r.backlog_at_end, "drain_per_s": r.drain_per_s(),
                "drains": r.drains.iter().map(|d| json!({
                    "per_s": d.per_s, "vacuum_secs": d.vacuum_secs,
                })).collect::<Vec<_>>(),
                "windows": r.windows.iter().map(|w| json!({
                    "end_secs": w.end_secs, "p50_ms": w.p50_ms, "p99_ms": w.p99_ms,
                    "commit_p99_ms": w.commit_p99_ms,
                    "published_per_s": w.published_per_s, "backlog": w.backlog,
                    "dead_tuples": w.dead_tuples, "index_bytes": w.index_bytes,
                    "vacuum_secs": w.vacuum_secs, "cpu_steal_share": w.steal,
                    "cpu_iowait_share": w.iowait,
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
    port: u16,
}

impl RelayProcess {
    fn start(binary: &Path, url: &str, port: u16, arrivals: &Arrivals) -> Result<Self> {
        let mut child = std::process::Command::new(binary)
            .arg("relay")
            .env("OUTBOX_DATABASE_URL", url)
            .env("OUTBOX_SCHEMA", SCHEMA)
            .env("OUTBOX_BROKER", "stdout")
            .env("OUTBOX_HTTP_LISTEN", format!("127.0.0.1:{port}"))
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
            port,
        })
    }

    /// Until the relay serves HTTP (it has connected and started).
    async fn ready(&mut self) -> Result<()> {
        let port = self.port;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the relay exited at start: {status}").into());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the relay did not listen on {port}").into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stop the relay (SIGTERM, then up to 10 s) off the runtime's threads: the
    /// other arm's producers run on them side by side.
    async fn stop(self) {
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
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

/// `VACUUM` of the outbox's tables every `every` (none when zero) until stopped,
/// standing in for autovacuum; when each one ran, to tell its share of a window
/// or a drain.
struct Vacuum {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    ran: Arc<Mutex<Vec<(Instant, Instant)>>>,
}

impl Vacuum {
    fn start(pool: PgPool, every: Duration) -> Self {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let ran: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
        let record = Arc::clone(&ran);
        let task = tokio::spawn(async move {
            if every.is_zero() {
                return;
            }
            let statement = format!(
                "VACUUM {SCHEMA}.outbox_events, {SCHEMA}.outbox_events_held, \
                 {SCHEMA}.outbox_events_relays"
            );
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stopped.changed() => return,
                }
                let began = Instant::now();
                if let Err(error) = sqlx::raw_sql(&statement).execute(&pool).await {
                    progress(format!("VACUUM failed: {error}"));
                }
                if let Ok(mut ran) = record.lock() {
                    ran.push((began, Instant::now()));
                }
            }
        });
        Self { stop, task, ran }
    }

    /// Seconds of `from..to` in which a `VACUUM` ran.
    fn seconds_within(&self, from: Instant, to: Instant) -> f64 {
        let ran = self.ran.lock().map(|r| r.clone()).unwrap_or_default();
        ran.iter().fold(0.0, |seconds, &(began, ended)| {
            seconds
                + ended
                    .min(to)
                    .saturating_duration_since(began.max(from))
                    .as_secs_f64()
        })
    }

    /// No new `VACUUM` starts; the running one ends. Once.
    async fn stop(&mut self) {
        let _ = self.stop.send(true);
        let _ = (&mut self.task).await;
    }
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

/// An arm's live traffic, done: its outbox (the snapshot still held in the held
/// arm) for the drains that follow.
struct Traffic {
    url: String,
    bench: Bench,
    holder: Option<PgConnection>,
    run: Run,
}

/// Run `arm`'s live traffic for `seconds` in the database of `url`: a fresh
/// outbox, the snapshot taken (held arm), the relay started, producers at the
/// offered rate, the server sampled at every window's end; until every event
/// arrived (at most 120 s after the producers stopped).
async fn traffic(
    url: &str,
    args: &HorizonArgs,
    binary: &Path,
    arm: Arm,
    seconds: u64,
) -> Result<Traffic> {
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
    let mut relay = RelayProcess::start(binary, url, arm.http_port(), &arrivals)?;
    relay.ready().await?;
    let mut vacuum = Vacuum::start(
        bench.pool.clone(),
        Duration::from_secs(args.vacuum_every_secs),
    );
    // Server state and CPU counters at the end of every window.
    let window = Duration::from_secs(args.window_secs.max(1));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let cpu_at_start = CpuTimes::read();
    let sampler = {
        let (pool, stop) = (bench.pool.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut states = Vec::new();
            let mut next = started + window;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(next.into()).await;
                let cpu = CpuTimes::read();
                states.push((next, server_state(&pool).await, cpu));
                next += window;
            }
            states
        })
    };
    let stamps = produce(&producers, args.rate, seconds, args.aggregates).await?;
    let arrived_at_stop = arrivals.lock().map(|a| a.len()).unwrap_or(0);
    let backlog_at_end = stamps.len().saturating_sub(arrived_at_stop) as u64;
    // The rest arrives (at most 120 s).
    let deadline = Instant::now() + Duration::from_secs(120);
    while arrivals.lock().map(|a| a.len()).unwrap_or(0) < stamps.len() && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.stop().await;
    vacuum.stop().await;
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
    // The producers sent for `seconds`: the windows cover that, not the last
    // commit's return.
    for k in 0..seconds.div_ceil(window.as_secs()) {
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
            .find(|(at, _, _)| *at >= to)
            .map_or((0, 0), |(_, state, _)| *state);
        // CPU counters at the window's start (the previous sample) and end.
        let cpu_from = match k {
            0 => cpu_at_start,
            _ => states.get(k as usize - 1).and_then(|(_, _, cpu)| *cpu),
        };
        let cpu_to = states.get(k as usize).and_then(|(_, _, cpu)| *cpu);
        let shares = cpu_from
            .zip(cpu_to)
            .and_then(|(from, to)| from.shares_until(&to));
        windows.push(Window {
            end_secs: (k + 1) * window.as_secs(),
            p50_ms: percentile(&ms, 0.50),
            p99_ms: percentile(&ms, 0.99),
            commit_p99_ms: percentile(&commit_ms, 0.99),
            published_per_s: published as f64 / window.as_secs_f64(),
            backlog: produced_by.saturating_sub(arrived_by) as u64,
            dead_tuples,
            index_bytes,
            vacuum_secs: vacuum.seconds_within(from, to),
            steal: shares.map(|s| s.steal),
            iowait: shares.map(|s| s.iowait),
        });
    }
    Ok(Traffic {
        url: url.to_string(),
        holder,
        run: Run {
            arm,
            database: database_of(url),
            p50_ms: percentile(&all, 0.50),
            p99_ms: percentile(&all, 0.99),
            windows,
            produced: stamps.len(),
            lost,
            backlog_at_end,
            drains: Vec::new(),
        },
        bench,
    })
}

impl Traffic {
    /// A backlog drained under the arm's conditions (the snapshot still held in
    /// the held arm, `VACUUM` as during the traffic): the events committed, a
    /// relay started; from its first output line to its last.
    async fn drain(&mut self, args: &HorizonArgs, binary: &Path) -> Result<()> {
        if args.drain_events == 0 {
            return Ok(());
        }
        let mut vacuum = Vacuum::start(
            self.bench.pool.clone(),
            Duration::from_secs(args.vacuum_every_secs),
        );
        self.bench.fill(args.drain_events, args.aggregates).await?;
        let drained: Arrivals = Arc::default();
        let mut relay = RelayProcess::start(binary, &self.url, self.run.arm.http_port(), &drained)?;
        relay.ready().await?;
        let deadline = Instant::now() + Duration::from_secs(600);
        let count = || drained.lock().map(|a| a.len()).unwrap_or(0);
        while count() < args.drain_events as usize && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        relay.stop().await;
        vacuum.stop().await;
        let drained = drained.lock().map(|a| a.clone()).unwrap_or_default();
        let (Some(first), Some(last)) = (drained.values().min(), drained.values().max()) else {
            return Err(
                format!("the {} arm's drain published nothing", self.run.arm.name()).into(),
            );
        };
        if (drained.len() as u64) < args.drain_events {
            return Err(format!(
                "the {} arm's drain published {} of {} events in 600 s",
                self.run.arm.name(),
                drained.len(),
                args.drain_events
            )
            .into());
        }
        let drain = Drain {
            per_s: drained.len() as f64 / last.duration_since(*first).as_secs_f64().max(1e-3),
            vacuum_secs: vacuum.seconds_within(*first, *last),
        };
        progress(format!(
            "{} arm: drain {:.0} events/s (VACUUM {:.1} s of it)",
            self.run.arm.name(),
            drain.per_s,
            drain.vacuum_secs
        ));
        self.run.drains.push(drain);
        Ok(())
    }

    /// The arm's figures; the snapshot, if held, is released.
    fn finish(self) -> Run {
        drop(self.holder);
        self.run
    }
}

/// `url` in three: up to the database, the database, and the query (`None` when
/// the URL names no database).
fn split_at_database(url: &str) -> Option<(&str, &str, Option<&str>)> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let (server, database) = base.rsplit_once('/')?;
    (server.contains("://") && !server.ends_with('/') && !database.is_empty())
        .then_some((server, database, query))
}

/// The database named in `url` (for the report).
fn database_of(url: &str) -> String {
    split_at_database(url).map_or("(the user's)".to_string(), |(_, database, _)| {
        database.to_string()
    })
}

/// `url` with its database replaced by `<database>_<suffix>`, created when
/// missing: the side-by-side unheld arm's, whose vacuum the held arm's snapshot
/// does not hold back (PostgreSQL computes a database's horizon from that
/// database's sessions).
async fn sibling_database(url: &str, suffix: &str) -> Result<String> {
    let Some((server, database, query)) = split_at_database(url) else {
        return Err(format!(
            "--side-by-side needs a database in the URL (postgres://host/database), not {url}"
        )
        .into());
    };
    let sibling = format!("{database}_{suffix}");
    let mut conn = PgConnection::connect(url).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&sibling)
            .fetch_one(&mut conn)
            .await?;
    if !exists {
        sqlx::raw_sql(&format!(
            "CREATE DATABASE \"{}\"",
            sibling.replace('"', "\"\"")
        ))
        .execute(&mut conn)
        .await?;
        progress(format!("created database {sibling} for the unheld arm"));
    }
    conn.close().await?;
    Ok(match query {
        Some(query) => format!("{server}/{sibling}?{query}"),
        None => format!("{server}/{sibling}"),
    })
}
