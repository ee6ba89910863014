//! Live traffic through the real `outbox` binary into NATS JetStream, starting from
//! an emptied and analysed table (the state autovacuum leaves a drained queue in).

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
    let mut results = Vec::new();
    for &relays in &args.relays {
        crate::progress(format!(
            "{relays} relay process(es), {} events/s for {} s",
            args.rate, args.duration_secs
        ));
        let result = nats::run(url, args, &binary, relays.max(1)).await?;
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
                r.drained_after
                    .map_or("not within 60 s".to_string(), |d| format!(
                        "{:.2} s",
                        d.as_secs_f64()
                    ))
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
            "scenario": "live", "rate": args.rate, "seconds": args.duration_secs,
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

/// The `outbox` binary to run, or an error saying how to build it.
#[cfg(feature = "nats")]
fn binary(given: Option<&PathBuf>) -> Result<PathBuf> {
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
                 `cargo build --release -p pgoutbox-relay --no-default-features --features nats` \
                 or pass --binary"
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
}

#[cfg(feature = "nats")]
mod nats {
    use std::collections::HashMap;
    use std::path::Path;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use futures_util::StreamExt;
    use uuid::Uuid;

    use super::{LiveArgs, LiveResult};
    use crate::db::{fresh_stream, produce_at_rate, Bench, SCHEMA};
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

    fn start(binary: &Path, url: &str, args: &LiveArgs, n: usize) -> Result<Relays> {
        let mut relays = Relays(Vec::new());
        for i in 0..n {
            let child = std::process::Command::new(binary)
                .arg("relay")
                .env("OUTBOX_DATABASE_URL", url)
                .env("OUTBOX_SCHEMA", SCHEMA)
                .env("OUTBOX_BROKER", "nats")
                .env("OUTBOX_NATS_URL", &args.nats_url)
                .env("OUTBOX_WORKERS", args.workers.max(1).to_string())
                .env(
                    "OUTBOX_SYNCHRONOUS_COMMIT",
                    args.synchronous_commit.to_string(),
                )
                .env("OUTBOX_NATS_SUBJECT_PREFIX", PREFIX)
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

    async fn pending(bench: &Bench) -> Result<i64> {
        Ok(sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {SCHEMA}.outbox_events WHERE processed_at IS NULL AND dead_at IS NULL"
        ))
        .fetch_one(&bench.pool)
        .await?)
    }

    pub(super) async fn run(
        url: &str,
        args: &LiveArgs,
        binary: &Path,
        n_relays: usize,
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

        let mut relays = start(binary, url, args, n_relays)?;
        wait_ready(&mut relays).await?;

        let total = args.rate * args.duration_secs;
        let committed = produce_at_rate(&bench.pool, &bench.outbox, args.rate, total).await?;
        let stopped = Instant::now();
        // Poll the backlog until it is gone (at most 60 s); note it at the 1 s mark.
        let mut backlog_after_1s = None;
        let drained_after = loop {
            let left = pending(&bench).await?;
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
        let mut millis: Vec<f64> = committed
            .iter()
            .filter_map(|(id, at)| first.get(id).map(|d| d.saturating_duration_since(*at)))
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        let lost = committed.len() - millis.len();
        millis.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((millis.len() as f64 * q).ceil() as usize).clamp(1, millis.len().max(1)) - 1;
            millis.get(i).copied().unwrap_or(f64::NAN)
        };
        Ok(LiveResult {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: millis.last().copied().unwrap_or(f64::NAN),
            produced: committed.len(),
            received: first.len(),
            duplicates,
            lost,
            backlog_after_1s,
            drained_after,
        })
    }
}
