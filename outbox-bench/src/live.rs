//! Live traffic through the real `outbox` binary into NATS JetStream, starting from
//! an emptied and analysed table (the state autovacuum leaves a drained queue in).
//! With `--outage-secs`, the relays reach NATS through a TCP proxy that is cut for
//! that long while the producers go on: what a long broker outage costs, from the
//! backlog it leaves to how soon deliveries are back to normal.

use std::path::PathBuf;
#[cfg(feature = "nats")]
use std::time::Duration;

use clap::Args;
#[cfg(feature = "nats")]
use serde_json::json;

use crate::{Report, Result};

#[derive(Args, Debug)]
pub(crate) struct LiveArgs {
    /// Offered rate, events per second (one event per producer transaction).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of offered load per relay count.
    #[arg(long, default_value_t = 60)]
    duration_secs: u64,
    /// Relay processes to run, one measurement per entry.
    #[arg(long, value_delimiter = ',', default_values = ["1", "4"])]
    relays: Vec<usize>,
    /// Claim loops per relay process (`relay.workers`): 2 lets the next claim start
    /// while a batch is published and recorded.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// `relay.synchronous_commit` of the relay processes: `false` lets a relay's
    /// record transaction commit without waiting for the WAL flush.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    synchronous_commit: bool,
    /// The `outbox` binary (default: `$CARGO_TARGET_DIR/release/outbox`, else
    /// `target/release/outbox`).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// NATS server.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// A broker outage of this many seconds during the offered load (0: none): the
    /// relays reach NATS through a TCP proxy that closes every connection and
    /// refuses new ones meanwhile. Producers keep committing.
    #[arg(long, default_value_t = 0)]
    outage_secs: u64,
    /// Seconds after the producers start at which the outage begins.
    #[arg(long, default_value_t = 10)]
    outage_after_secs: u64,
    /// Run the relays with the console enabled (`OUTBOX_CONSOLE`), nobody looking:
    /// what its sampling costs an idle console's relay.
    #[arg(long)]
    console: bool,
}

#[cfg(feature = "nats")]
impl LiveArgs {
    /// The outage, if one is asked for, checked against the load's duration.
    fn outage(&self) -> Result<Option<Outage>> {
        if self.outage_secs == 0 {
            return Ok(None);
        }
        if self.outage_after_secs + self.outage_secs >= self.duration_secs {
            return Err(format!(
                "--outage-after-secs ({}) + --outage-secs ({}) must end before \
                 --duration-secs ({}): the load must outlast the outage",
                self.outage_after_secs, self.outage_secs, self.duration_secs
            )
            .into());
        }
        Ok(Some(Outage {
            after: Duration::from_secs(self.outage_after_secs),
            length: Duration::from_secs(self.outage_secs),
        }))
    }
}

/// When the broker goes away, counted from the producers' start, and for how long.
#[cfg(feature = "nats")]
#[derive(Debug, Clone, Copy)]
struct Outage {
    after: Duration,
    length: Duration,
}

/// Live traffic into NATS through the binary.
#[cfg(not(feature = "nats"))]
pub(crate) async fn live(_url: &str, args: &LiveArgs) -> Result<Report> {
    let _ = (
        args.rate,
        args.duration_secs,
        &args.relays,
        args.workers,
        args.synchronous_commit,
        &args.binary,
        &args.nats_url,
    );
    Err("live needs the `nats` feature: cargo run --release -p outbox-bench --features nats -- live".into())
}

/// Live traffic into NATS through the binary.
#[cfg(feature = "nats")]
pub(crate) async fn live(url: &str, args: &LiveArgs) -> Result<Report> {
    let binary = binary(args.binary.as_ref())?;
    if let Some(outage) = args.outage()? {
        return outage_report(url, args, &binary, outage).await;
    }
    let mut results = Vec::new();
    for &relays in &args.relays {
        crate::progress(format!(
            "{relays} relay process(es), {} events/s for {} s",
            args.rate, args.duration_secs
        ));
        let result = nats::run(url, args, &binary, relays.max(1), None).await?;
        crate::progress(format!(
            "{relays} relay(s): p50 {:.2} p99 {:.2} max {:.1} ms, backlog after 1 s {}",
            result.p50, result.p99, result.max, result.backlog_after_1s
        ));
        results.push((relays, result));
    }
    let met = results
        .iter()
        .all(|(_, r)| r.p99 <= 10.0 && r.backlog_after_1s == 0 && r.lost == 0);
    let parts: Vec<String> = results
        .iter()
        .map(|(relays, r)| {
            format!(
                "{relays} relay(s): p50 {:.2} p99 {:.2} max {:.1} ms, {} received of {} \
                 ({} duplicates, {} lost), backlog 1 s after the producers stopped: {}, \
                 drained {} after",
                r.p50,
                r.p99,
                r.max,
                r.received,
                r.produced,
                r.duplicates,
                r.lost,
                r.backlog_after_1s,
                seconds(r.drained_after, "not within 60 s"),
            )
        })
        .collect();
    Ok(Report {
        line: format!(
            "live: `outbox relay` processes ({} worker(s) each, synchronous_commit {}) into \
             NATS JetStream, {} events/s for {} s from an emptied and analysed table, \
             commit-to-delivery: {}; target p99 <= 10 ms and backlog 0 within 1 s: {}",
            args.workers,
            args.synchronous_commit,
            args.rate,
            args.duration_secs,
            parts.join("; "),
            crate::verdict(met)
        ),
        json: json!({
            "scenario": "live", "rate": args.rate, "seconds": args.duration_secs, "console": args.console,
            "workers": args.workers, "synchronous_commit": args.synchronous_commit,
            "runs": results.iter().map(|(relays, r)| json!({
                "relays": relays, "p50_ms": r.p50, "p90_ms": r.p90, "p99_ms": r.p99,
                "max_ms": r.max, "produced": r.produced, "received": r.received,
                "duplicates": r.duplicates, "lost": r.lost,
                "backlog_after_1s": r.backlog_after_1s,
                "drained_after_s": r.drained_after.map(|d| d.as_secs_f64()),
            })).collect::<Vec<_>>(),
            "target_met": met,
        }),
    })
}

/// Live traffic with a broker outage in the middle: how the relays come back.
#[cfg(feature = "nats")]
async fn outage_report(
    url: &str,
    args: &LiveArgs,
    binary: &std::path::Path,
    outage: Outage,
) -> Result<Report> {
    let mut results = Vec::new();
    for &relays in &args.relays {
        crate::progress(format!(
            "{relays} relay process(es), {} events/s for {} s, broker cut for {} s after {} s",
            args.rate, args.duration_secs, args.outage_secs, args.outage_after_secs
        ));
        let result = nats::run(url, args, binary, relays.max(1), Some(outage)).await?;
        let Some(o) = &result.outage else {
            return Err("the outage was not measured".into());
        };
        crate::progress(format!(
            "{relays} relay(s): backlog peak {}, resumed {} after the broker came back, \
             caught up {} after, {} dead letters",
            o.backlog_peak,
            seconds(o.resumed_after, "never"),
            seconds(o.caught_up_after, "never"),
            o.dead_letters
        ));
        results.push((relays, result));
    }
    let met = results.iter().all(|(_, r)| {
        r.lost == 0
            && r.drained_after.is_some()
            && r.outage.as_ref().is_some_and(|o| o.dead_letters == 0)
    });
    let parts: Vec<String> = results
        .iter()
        .filter_map(|(relays, r)| {
            let o = r.outage.as_ref()?;
            Some(format!(
                "{relays} relay(s): backlog peak {} events; resumed {} after the broker \
                 came back, backlog under {} events {} after; latency of events committed \
                 during the outage max {:.1} s; after catching up p50 {:.2} p99 {:.2} max {:.1} \
                 ms; {} received of {} ({} duplicates, {} lost), {} dead letters, drained {} \
                 after the producers stopped",
                o.backlog_peak,
                seconds(o.resumed_after, "never"),
                o.caught_up_below,
                seconds(o.caught_up_after, "never"),
                o.during_max_ms / 1000.0,
                o.after_p50,
                o.after_p99,
                o.after_max,
                r.received,
                r.produced,
                r.duplicates,
                r.lost,
                o.dead_letters,
                seconds(r.drained_after, "not within 60 s"),
            ))
        })
        .collect();
    Ok(Report {
        line: format!(
            "live --outage-secs {}: `outbox relay` processes ({} worker(s) each) into NATS \
             JetStream through a TCP proxy cut for {} s, {} s into {} s of {} events/s from \
             an emptied and analysed table: {}; nothing lost, no dead letter, drained: {}",
            args.outage_secs,
            args.workers,
            args.outage_secs,
            args.outage_after_secs,
            args.duration_secs,
            args.rate,
            parts.join("; "),
            crate::verdict(met)
        ),
        json: json!({
            "scenario": "live-outage", "rate": args.rate, "seconds": args.duration_secs,
            "outage_secs": args.outage_secs, "outage_after_secs": args.outage_after_secs,
            "workers": args.workers,
            "runs": results.iter().map(|(relays, r)| {
                let o = r.outage.as_ref();
                json!({
                    "relays": relays, "produced": r.produced, "received": r.received,
                    "duplicates": r.duplicates, "lost": r.lost,
                    "drained_after_s": r.drained_after.map(|d| d.as_secs_f64()),
                    "backlog_peak": o.map(|o| o.backlog_peak),
                    "resumed_after_s": o.and_then(|o| o.resumed_after).map(|d| d.as_secs_f64()),
                    "caught_up_below": o.map(|o| o.caught_up_below),
                    "caught_up_after_s": o.and_then(|o| o.caught_up_after).map(|d| d.as_secs_f64()),
                    "during_max_ms": o.map(|o| o.during_max_ms),
                    "after_p50_ms": o.map(|o| o.after_p50), "after_p99_ms": o.map(|o| o.after_p99),
                    "after_max_ms": o.map(|o| o.after_max),
                    "dead_letters": o.map(|o| o.dead_letters),
                })
            }).collect::<Vec<_>>(),
            "target_met": met,
        }),
    })
}

/// A duration in seconds, or `otherwise` when there is none (not within the wait).
#[cfg(feature = "nats")]
fn seconds(d: Option<Duration>, otherwise: &str) -> String {
    d.map_or(otherwise.to_string(), |d| {
        format!("{:.2} s", d.as_secs_f64())
    })
}

/// The `outbox` binary to run, or an error saying how to build it.
pub(crate) fn binary(given: Option<&PathBuf>) -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = match given {
        Some(path) => vec![path.clone()],
        None => std::env::var_os("CARGO_TARGET_DIR")
            .map(|dir| PathBuf::from(dir).join("release/outbox"))
            .into_iter()
            .chain([PathBuf::from("target/release/outbox")])
            .collect(),
    };
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "the `outbox` binary is not at {candidates:?}; build it with \
                 `cargo build --release -p pgoutbox-relay` or pass --binary"
            )
            .into()
        })
}

/// What one measurement found.
#[cfg(feature = "nats")]
struct LiveResult {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    produced: usize,
    received: usize,
    duplicates: usize,
    lost: usize,
    backlog_after_1s: i64,
    /// From the producers' stop to an empty backlog; `None`: not within 60 s.
    drained_after: Option<Duration>,
    /// What the outage did, when there was one.
    outage: Option<OutageResult>,
}

/// How the relays went through a broker outage.
#[cfg(feature = "nats")]
struct OutageResult {
    /// Most events pending at any sample (every 50 ms).
    backlog_peak: i64,
    /// From the end of the outage to the first delivery of an event committed during
    /// it: when the relays published again. (Not the first delivery of all: the
    /// NATS client sends what it buffered while disconnected as soon as it is
    /// back, messages the relay had already given up on.)
    resumed_after: Option<Duration>,
    /// The backlog under which the relays count as caught up: 10 ms of offered load.
    caught_up_below: i64,
    /// From the end of the outage to the first sample under `caught_up_below`.
    caught_up_after: Option<Duration>,
    /// Longest commit-to-delivery of the events committed during the outage.
    during_max_ms: f64,
    /// Commit-to-delivery of the events committed once caught up.
    after_p50: f64,
    after_p99: f64,
    after_max: f64,
    /// Dead letters at the end (an outage must make none).
    dead_letters: i64,
}

#[cfg(feature = "nats")]
mod nats {
    use std::collections::HashMap;
    use std::net::ToSocketAddrs;
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use futures_util::StreamExt;
    use pgoutbox_core::conformance::proxy::TcpProxy;
    use sqlx::PgPool;
    use uuid::Uuid;

    use super::{LiveArgs, LiveResult, Outage, OutageResult};
    use crate::db::{fresh_stream, produce_at_rate, Bench, SCHEMA};
    use crate::stats::{latency_millis, Percentiles};
    use crate::Result;

    const PREFIX: &str = "outboxlive";
    const STREAM: &str = "OUTBOX_LIVE";
    /// First port of the relays' HTTP endpoints (one each).
    const HTTP_PORT: u16 = 19_187;

    type Stamps = Arc<Mutex<Vec<(Uuid, Instant)>>>;

    /// Relay processes, stopped (SIGTERM, then SIGKILL) when dropped.
    struct Relays(Vec<std::process::Child>);

    impl Drop for Relays {
        fn drop(&mut self) {
            for child in &mut self.0 {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            for child in &mut self.0 {
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    fn start(
        binary: &Path,
        url: &str,
        nats_url: &str,
        args: &LiveArgs,
        n: usize,
    ) -> Result<Relays> {
        let mut relays = Relays(Vec::new());
        for i in 0..n {
            let child = std::process::Command::new(binary)
                .arg("relay")
                .env("OUTBOX_DATABASE_URL", url)
                .env("OUTBOX_SCHEMA", SCHEMA)
                .env("OUTBOX_BROKER", "nats")
                .env("OUTBOX_NATS_URL", nats_url)
                .env("OUTBOX_WORKERS", args.workers.max(1).to_string())
                .env(
                    "OUTBOX_SYNCHRONOUS_COMMIT",
                    args.synchronous_commit.to_string(),
                )
                .env("OUTBOX_NATS_SUBJECT_PREFIX", PREFIX)
                .env("OUTBOX_CONSOLE", args.console.to_string())
                .env(
                    "OUTBOX_HTTP_LISTEN",
                    format!("127.0.0.1:{}", HTTP_PORT + i as u16),
                )
                .env_remove("OUTBOX_CONFIG")
                .env_remove("OUTBOX_LOG")
                .env("RUST_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
            relays.0.push(child);
        }
        Ok(relays)
    }

    /// Wait until every relay serves HTTP (it has connected and started).
    async fn wait_ready(relays: &mut Relays) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        for i in 0..relays.0.len() {
            let port = HTTP_PORT + i as u16;
            loop {
                if let Ok(Some(status)) = relays.0[i].try_wait() {
                    return Err(format!("relay process {i} exited at start: {status}").into());
                }
                if tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("relay process {i} did not listen on {port}").into());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    async fn pending(pool: &PgPool) -> Result<i64> {
        Ok(sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {SCHEMA}.outbox_events WHERE processed_at IS NULL AND dead_at IS NULL"
        ))
        .fetch_one(pool)
        .await?)
    }

    async fn dead_letters(pool: &PgPool) -> Result<i64> {
        Ok(sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {SCHEMA}.outbox_events WHERE dead_at IS NOT NULL"
        ))
        .fetch_one(pool)
        .await?)
    }

    /// The relays' way to NATS during an outage run: a TCP proxy, cut on schedule.
    struct BrokerLink {
        proxy: Arc<TcpProxy>,
        outage: Outage,
    }

    impl BrokerLink {
        fn start(nats_url: &str, outage: Outage) -> Result<Self> {
            let address = nats_url
                .trim_start_matches("nats://")
                .to_socket_addrs()
                .map_err(|e| format!("--nats-url {nats_url}: {e}"))?
                .next()
                .ok_or_else(|| format!("--nats-url {nats_url}: no address"))?;
            let proxy = TcpProxy::start(address).map_err(|e| format!("TCP proxy: {e}"))?;
            Ok(Self {
                proxy: Arc::new(proxy),
                outage,
            })
        }

        fn url(&self) -> String {
            format!("nats://{}", self.proxy.addr())
        }

        /// Cut the link `after` from now for `length`; the cut's start and end.
        fn schedule(&self) -> tokio::task::JoinHandle<(Instant, Instant)> {
            let (proxy, outage) = (Arc::clone(&self.proxy), self.outage);
            tokio::spawn(async move {
                tokio::time::sleep(outage.after).await;
                proxy.cut();
                let cut = Instant::now();
                tokio::time::sleep(outage.length).await;
                proxy.restore();
                (cut, Instant::now())
            })
        }
    }

    /// The backlog every 50 ms until `stop` is set.
    fn sample_backlog(
        pool: PgPool,
        stop: Arc<AtomicBool>,
    ) -> tokio::task::JoinHandle<Vec<(Instant, i64)>> {
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(n) = pending(&pool).await {
                    samples.push((Instant::now(), n));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            samples
        })
    }

    pub(super) async fn run(
        url: &str,
        args: &LiveArgs,
        binary: &Path,
        n_relays: usize,
        outage: Option<Outage>,
    ) -> Result<LiveResult> {
        let bench = Bench::fresh(url).await?;
        bench.analyze().await?;
        bench.checkpoint().await?;

        let publisher = fresh_stream(&args.nats_url, PREFIX, STREAM).await?;
        let mut subscription = publisher
            .client()
            .subscribe(format!("{PREFIX}.>"))
            .await
            .map_err(|e| format!("subscribe: {e}"))?;
        // The server knows of the subscription before the first event can arrive.
        publisher
            .client()
            .flush()
            .await
            .map_err(|e| format!("flush: {e}"))?;
        let arrived: Stamps = Arc::default();
        let collector = {
            let arrived = Arc::clone(&arrived);
            tokio::spawn(async move {
                while let Some(message) = subscription.next().await {
                    let now = Instant::now();
                    let id = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(pgoutbox_core::envelope::EVENT_ID))
                        .and_then(|v| Uuid::parse_str(v.as_str()).ok());
                    if let (Some(id), Ok(mut arrived)) = (id, arrived.lock()) {
                        arrived.push((id, now));
                    }
                }
            })
        };

        let link = outage
            .map(|outage| BrokerLink::start(&args.nats_url, outage))
            .transpose()?;
        let relay_nats_url = link.as_ref().map_or(args.nats_url.clone(), BrokerLink::url);
        let mut relays = start(binary, url, &relay_nats_url, args, n_relays)?;
        wait_ready(&mut relays).await?;

        let stop_sampling = Arc::new(AtomicBool::new(false));
        let sampler = link
            .is_some()
            .then(|| sample_backlog(bench.pool.clone(), Arc::clone(&stop_sampling)));
        let cut = link.as_ref().map(BrokerLink::schedule);
        let total = args.rate * args.duration_secs;
        let committed = produce_at_rate(&bench.pool, &bench.outbox, args.rate, total).await?;
        let stopped = Instant::now();
        // Poll the backlog until it is gone (at most 60 s); note it at the 1 s mark.
        let mut backlog_after_1s = None;
        let drained_after = loop {
            let left = pending(&bench.pool).await?;
            let elapsed = stopped.elapsed();
            if elapsed >= Duration::from_secs(1) && backlog_after_1s.is_none() {
                backlog_after_1s = Some(left);
            }
            if left == 0 {
                break Some(elapsed);
            }
            if elapsed > Duration::from_secs(60) {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let backlog_after_1s = backlog_after_1s.unwrap_or(0);
        // Deliveries trail the PubAck by a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while arrived.lock().map(|a| a.len()).unwrap_or(0) < committed.len()
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop_sampling.store(true, Ordering::Relaxed);
        let samples = match sampler {
            Some(sampler) => sampler.await.map_err(|e| format!("backlog sampler: {e}"))?,
            None => Vec::new(),
        };
        let cut = match cut {
            Some(cut) => Some(cut.await.map_err(|e| format!("outage schedule: {e}"))?),
            None => None,
        };
        let dead_letters = dead_letters(&bench.pool).await?;
        drop(relays);
        collector.abort();
        let _ = publisher.jetstream().delete_stream(STREAM).await;

        let arrived = arrived.lock().map(|a| a.clone()).unwrap_or_default();
        let mut first: HashMap<Uuid, Instant> = HashMap::with_capacity(arrived.len());
        let mut duplicates = 0;
        for (id, at) in &arrived {
            if first.insert(*id, *at).is_some() {
                duplicates += 1;
            }
        }
        // Commit-to-delivery of each delivered event, with its commit instant.
        let latencies: Vec<(Instant, f64)> = committed
            .iter()
            .filter_map(|(id, at)| first.get(id).map(|d| (*at, latency_millis(*at, *d))))
            .collect();
        let lost = committed.len() - latencies.len();
        let all = Percentiles::of(latencies.iter().map(|(_, ms)| *ms));
        let outage = cut.map(|(cut, restored)| {
            let caught_up_below = i64::try_from((args.rate / 100).max(1)).unwrap_or(i64::MAX);
            let caught_up_at = samples
                .iter()
                .find(|(at, n)| *at >= restored && *n < caught_up_below)
                .map(|(at, _)| *at);
            let after = Percentiles::of(
                latencies
                    .iter()
                    .filter(|(at, _)| caught_up_at.is_some_and(|c| *at >= c))
                    .map(|(_, ms)| *ms),
            );
            OutageResult {
                backlog_peak: samples.iter().map(|(_, n)| *n).max().unwrap_or(0),
                resumed_after: committed
                    .iter()
                    .filter(|(_, at)| *at >= cut && *at < restored)
                    .filter_map(|(id, _)| first.get(id))
                    .min()
                    .map(|at| at.saturating_duration_since(restored)),
                caught_up_below,
                caught_up_after: caught_up_at.map(|at| at - restored),
                during_max_ms: latencies
                    .iter()
                    .filter(|(at, _)| *at >= cut && *at < restored)
                    .map(|(_, ms)| *ms)
                    .fold(0.0, f64::max),
                after_p50: after.at(0.50),
                after_p99: after.at(0.99),
                after_max: after.max(),
                dead_letters,
            }
        });
        Ok(LiveResult {
            p50: all.at(0.50),
            p90: all.at(0.90),
            p99: all.at(0.99),
            max: all.max(),
            produced: committed.len(),
            received: first.len(),
            duplicates,
            lost,
            backlog_after_1s,
            drained_after,
            outage,
        })
    }
}
