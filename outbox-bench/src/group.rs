//! Fairness of a `RelayGroup`: one tenant with a large backlog and many small
//! tenants with live traffic, relayed by one group on one pool.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{DynPublisher, NewEvent, Relay, RelayConfig};
use pgoutbox_postgres::{Outbox, PgStore, RelayGroup, Tables, Wakeup};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use crate::db::event_of;
use crate::latency::{commit_to_publish_millis, quantile, Stamping};
use crate::{progress, verdict, Report, Result};

#[derive(Args, Debug)]
pub(crate) struct GroupArgs {
    /// Tenant schemas (`outbox_bench_t<i>`, dropped and created again); tenant 0
    /// has the backlog, the others live traffic.
    #[arg(long, default_value_t = 50)]
    tenants: usize,
    /// Events waiting in tenant 0 when the group starts.
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Events per second offered to each small tenant, one per transaction.
    #[arg(long, default_value_t = 10)]
    rate: u64,
    /// The group's connection budget: its pool's size.
    #[arg(long, default_value_t = 8)]
    connections: u32,
    /// For comparison: the same relays on the same pool, each with its own
    /// adaptive wake-up probe, instead of a `RelayGroup`'s shared one.
    #[arg(long)]
    separate_probes: bool,
    /// Prepared statements kept per connection of the relays' pool (sqlx's default
    /// is 100; 50 tenants use several statements each).
    #[arg(long, default_value_t = 100)]
    statement_cache: usize,
}

/// The start of the group, reported apart from its steady state.
const WARM_UP: Duration = Duration::from_secs(1);

fn tenant(i: usize) -> Result<Tables> {
    Ok(Tables::in_schema(&format!("outbox_bench_t{i}"))?)
}

/// Drop and create every tenant schema, migrated.
async fn fresh_tenants(pool: &PgPool, n: usize) -> Result<Vec<Tables>> {
    let mut all = Vec::with_capacity(n);
    for i in 0..n {
        let tables = tenant(i)?;
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            tables.schema().quoted()
        ))
        .execute(pool)
        .await?;
        pgoutbox_postgres::migrate(pool, &tables).await?;
        all.push(tables);
    }
    Ok(all)
}

/// Write `n` events over 10,000 aggregates into `tables`, 5,000 per transaction,
/// then analyse the table (as a relay would find a backlog left while it was down).
async fn fill(url: &str, pool: &PgPool, tables: &Tables, n: u64) -> Result<()> {
    let outbox = Outbox::new(tables.clone());
    let mut conn = PgConnection::connect(url).await?;
    let mut from = 0;
    while from < n {
        let events: Vec<NewEvent> = (from..(from + 5000).min(n))
            .map(|i| event_of(i, i % 10_000))
            .collect();
        let mut tx = conn.begin().await?;
        outbox.enqueue_many(&mut tx, &events).await?;
        tx.commit().await?;
        from += 5000;
    }
    sqlx::query(&format!(
        "ANALYZE {}.{}",
        tables.schema().quoted(),
        tables.events().quoted()
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// Wait until `stamping` saw `n` events (at most `limit`); the time it took.
async fn published(stamping: &Stamping, n: usize, limit: Duration) -> Result<Duration> {
    let started = Instant::now();
    while stamping.count() < n {
        if started.elapsed() > limit {
            return Err(format!(
                "{} of {n} events published after {} s",
                stamping.count(),
                limit.as_secs()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(started.elapsed())
}

pub(crate) async fn group(url: &str, args: &GroupArgs) -> Result<Report> {
    let tenants = args.tenants.max(2);
    let admin = PgPoolOptions::new().max_connections(4).connect(url).await?;
    let budget = args.connections.max(2);
    let options = sqlx::postgres::PgConnectOptions::from_str(url)?
        .statement_cache_capacity(args.statement_cache);
    let relay_pool = || -> Result<PgPool> {
        Ok(PgPoolOptions::new()
            .max_connections(budget)
            .connect_lazy_with(options.clone()))
    };
    let all = fresh_tenants(&admin, tenants).await?;
    let limit = Duration::from_secs(60 + args.backlog / 1000);

    // The big tenant alone: one relay on a pool of the same budget.
    progress(format!("tenant 0 alone: {} events", args.backlog));
    fill(url, &admin, &all[0], args.backlog).await?;
    let alone = Stamping::default();
    let store = PgStore::new(relay_pool()?, all[0].clone());
    let relay = Relay::new(store, alone.clone()).with_config(RelayConfig::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (took, ()) = tokio::join!(
        async {
            let took = published(&alone, args.backlog as usize, limit).await;
            let _ = stop.send(());
            took
        },
        relay.run(async {
            let _ = stopped.await;
        })
    );
    let dedicated = args.backlog as f64 / took?.as_secs_f64();
    progress(format!("dedicated relay: {dedicated:.0} events/s"));

    // The group: tenant 0 with its backlog again, the others offered live events
    // while it drains.
    progress(format!(
        "group of {tenants} on {budget} connections: tenant 0 with {} events, {} tenants at {} events/s",
        args.backlog,
        tenants - 1,
        args.rate
    ));
    fill(url, &admin, &all[0], args.backlog).await?;
    // Tenant 0's publisher apart, to see its backlog's end.
    let (backlog_stamps, stamping) = (Stamping::default(), Stamping::default());
    let pool = relay_pool()?;
    let mut group = RelayGroup::new();
    for (i, tables) in all.iter().enumerate() {
        let stamps = if i == 0 { &backlog_stamps } else { &stamping };
        let publisher: Arc<dyn DynPublisher> = Arc::new(stamps.clone());
        group.add(
            PgStore::new(pool.clone(), tables.clone()),
            publisher,
            RelayConfig::default(),
        );
    }
    let committed: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
    let producers = PgPoolOptions::new().max_connections(8).connect(url).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let mut big_took = None;
    let drive = async {
        let small: Vec<Outbox> = all[1..].iter().cloned().map(Outbox::new).collect();
        let period = Duration::from_secs_f64(1.0 / (args.rate.max(1) * small.len() as u64) as f64);
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = tokio::task::JoinSet::new();
        let mut i = 0u64;
        // Offer live events until the backlog is drained.
        loop {
            if backlog_stamps.count() >= args.backlog as usize {
                big_took = Some(started.elapsed());
                break;
            }
            if started.elapsed() > limit {
                return Err::<(), Box<dyn std::error::Error + Send + Sync>>(
                    "the backlog did not drain in time".into(),
                );
            }
            ticks.tick().await;
            let outbox = small[(i as usize) % small.len()].clone();
            let (pool, committed) = (producers.clone(), Arc::clone(&committed));
            let event = event_of(1_000_000_000 + i, i % 100);
            i += 1;
            tasks.spawn(async move {
                let mut tx = pool.begin().await?;
                let id = outbox.enqueue(&mut tx, &event).await?;
                tx.commit().await?;
                if let Ok(mut c) = committed.lock() {
                    c.push((id, Instant::now()));
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
        // The last live events.
        let expected = committed.lock().map(|c| c.len()).unwrap_or(0);
        published(&stamping, expected, Duration::from_secs(30)).await?;
        let _ = stop.send(());
        Ok(())
    };
    let separate: Vec<_> = group
        .relays()
        .iter()
        .map(|r| {
            let store = r.store().clone().with_wakeup(Wakeup::adaptive());
            Relay::new(store, Arc::clone(r.publisher())).with_config(RelayConfig::default())
        })
        .collect();
    let relays = async {
        if args.separate_probes {
            let (halt, halted) = tokio::sync::watch::channel(false);
            let stop_all = async {
                let _ = stopped.await;
                let _ = halt.send(true);
            };
            let runs = futures_util::future::join_all(separate.iter().map(|relay| {
                let mut halted = halted.clone();
                relay.run(async move {
                    let _ = halted.wait_for(|h| *h).await;
                })
            }));
            tokio::join!(stop_all, runs);
        } else {
            group
                .run(async {
                    let _ = stopped.await;
                })
                .await;
        }
    };
    let (driven, ()) = tokio::join!(drive, relays);
    driven?;
    let big_took = big_took.ok_or("the backlog's end was not seen")?;
    let shared = args.backlog as f64 / big_took.as_secs_f64();
    let committed = committed.lock().map(|c| c.clone()).unwrap_or_default();
    let millis = commit_to_publish_millis(&committed, &stamping.published())?;
    let (p50, p99, max) = (
        quantile(&millis, 0.50),
        quantile(&millis, 0.99),
        millis.last().copied().unwrap_or(0.0),
    );
    // The same events without those committed in the group's first second: its
    // start (50 relays' first claims, each statement prepared on each connection)
    // against its steady state.
    let warm_from = started + WARM_UP;
    let warm: Vec<(Uuid, Instant)> = committed
        .iter()
        .filter(|(_, at)| *at >= warm_from)
        .copied()
        .collect();
    let warm_millis = commit_to_publish_millis(&warm, &stamping.published())?;
    let warm_p99 = quantile(&warm_millis, 0.99);
    let ratio = shared / dedicated;
    for tables in &all {
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            tables.schema().quoted()
        ))
        .execute(&admin)
        .await?;
    }
    Ok(Report {
        line: format!(
            "group{}: {tenants} tenants on {budget} connections; tenant 0's {} events drained at \
             {shared:.0}/s against {dedicated:.0}/s alone ({ratio:.2}; target >= 0.7: {}); \
             {} live events of {} tenants at {} events/s each: commit-to-publish p50 {p50:.2} ms, \
             p99 {p99:.2} ms (target <= 50: {}), max {max:.1} ms; committed after the first {} s: \
             {} events, p99 {warm_p99:.2} ms ({})",
            if args.separate_probes {
                " (separate probes)"
            } else {
                ""
            },
            args.backlog,
            verdict(ratio >= 0.7),
            millis.len(),
            tenants - 1,
            args.rate,
            verdict(p99 <= 50.0),
            WARM_UP.as_secs(),
            warm_millis.len(),
            verdict(warm_p99 <= 50.0),
        ),
        json: json!({
            "scenario": "group", "separate_probes": args.separate_probes, "tenants": tenants, "connections": budget,
            "backlog": args.backlog, "rate_per_tenant": args.rate,
            "backlog_per_s": shared, "dedicated_per_s": dedicated, "ratio": ratio,
            "live_events": millis.len(),
            "latency_ms": {"p50": p50, "p99": p99, "max": max},
            "after_warm_up": {"seconds": WARM_UP.as_secs(), "events": warm_millis.len(), "p99_ms": warm_p99},
        }),
    })
}
