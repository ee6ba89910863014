//! Fairness of a `RelayGroup`: one tenant with a large backlog and many small
//! tenants with live traffic, relayed by one group on one pool.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pgoutbox_core::{DynPublisher, Relay, RelayConfig};
use pgoutbox_postgres::{Outbox, PgStore, RelayGroup, Tables, Wakeup};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

use crate::db::{event_of, fill_outbox, run_while, Keys};
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
    /// Prepared statements kept per connection of the relays' pools: 1000, as the
    /// `outbox` binary gives a process relaying several outboxes (sqlx's default
    /// is 100; 50 tenants use several statements each).
    #[arg(long, default_value_t = 1000)]
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

/// Write `n` events over 10,000 aggregates into `tables` (as `Bench::fill` does),
/// then analyse the table (as a relay would find a backlog left while it was down).
async fn fill(url: &str, pool: &PgPool, tables: &Tables, n: u64) -> Result<()> {
    let outbox = Outbox::new(tables.clone());
    fill_outbox(url, &outbox, n, &Keys::Uniform(10_000)).await?;
    sqlx::query(&format!(
        "ANALYZE {}.{}",
        tables.schema().quoted(),
        tables.events().quoted()
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// How the tenants are relayed in one measured phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// One `RelayGroup` for every tenant on one pool: what is measured.
    Group,
    /// The same relays on the same pool, each with its own wake-up probe.
    SeparateProbes,
    /// Tenant 0 on a relay and a pool of its own, the others in a group on
    /// another pool of the same size: a dedicated relay under the same live
    /// traffic, the baseline the group is held against.
    Dedicated,
}

/// What one phase measured.
struct Phase {
    /// Tenant 0's backlog drain rate, events/s.
    big_rate: f64,
    /// Commit-to-publish of every live event, sorted.
    millis: Vec<f64>,
    /// The same for the events committed after the first [`WARM_UP`].
    warm_millis: Vec<f64>,
}

/// Fill tenant 0's backlog, start the relays as `layout` says, offer live events
/// to the other tenants until the backlog is drained.
async fn phase(
    url: &str,
    admin: &PgPool,
    all: &[Tables],
    args: &GroupArgs,
    layout: Layout,
    relay_pool: &dyn Fn() -> Result<PgPool>,
) -> Result<Phase> {
    let limit = Duration::from_secs(60 + args.backlog / 1000);
    fill(url, admin, &all[0], args.backlog).await?;
    // Tenant 0's publisher apart, to see its backlog's end.
    let (backlog_stamps, stamping) = (Stamping::default(), Stamping::default());
    let pool = relay_pool()?;
    let mut group = RelayGroup::new();
    let mut alone = RelayGroup::new();
    let others_pool = relay_pool()?;
    for (i, tables) in all.iter().enumerate() {
        let stamps = if i == 0 { &backlog_stamps } else { &stamping };
        let publisher: Arc<dyn DynPublisher> = Arc::new(stamps.clone());
        let (target, pool) = match (layout, i) {
            (Layout::Dedicated, 0) => (&mut alone, &pool),
            (Layout::Dedicated, _) => (&mut group, &others_pool),
            _ => (&mut group, &pool),
        };
        target.add(
            PgStore::new(pool.clone(), tables.clone()),
            publisher,
            RelayConfig::default(),
        );
    }
    let committed: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
    let producers = PgPoolOptions::new().max_connections(8).connect(url).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
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
        stamping.wait_for(expected, Duration::from_secs(30)).await?;
        let _ = stop.send(true);
        Ok(())
    };
    let until_stopped = || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let relays = async {
        if layout == Layout::SeparateProbes {
            let separate: Vec<_> = group
                .relays()
                .iter()
                .map(|r| {
                    let store = r.store().clone().with_wakeup(Wakeup::adaptive());
                    Relay::new(store, Arc::clone(r.publisher())).with_config(RelayConfig::default())
                })
                .collect();
            futures_util::future::join_all(separate.iter().map(|relay| relay.run(until_stopped())))
                .await;
        } else {
            tokio::join!(group.run(until_stopped()), alone.run(until_stopped()));
        }
    };
    let (driven, ()) = tokio::join!(drive, relays);
    driven?;
    let big_took = big_took.ok_or("the backlog's end was not seen")?;
    let committed = committed.lock().map(|c| c.clone()).unwrap_or_default();
    let millis = commit_to_publish_millis(&committed, &stamping.published())?;
    // The same events without those committed in the first second: the relays'
    // start (50 relays' first claims, each statement prepared on each
    // connection) apart from their steady state.
    let warm: Vec<(Uuid, Instant)> = committed
        .iter()
        .filter(|(_, at)| *at >= started + WARM_UP)
        .copied()
        .collect();
    let warm_millis = commit_to_publish_millis(&warm, &stamping.published())?;
    producers.close().await;
    pool.close().await;
    others_pool.close().await;
    Ok(Phase {
        big_rate: args.backlog as f64 / big_took.as_secs_f64(),
        millis,
        warm_millis,
    })
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

    // The big tenant alone on the machine: one relay on a pool of the same budget.
    progress(format!("tenant 0 alone: {} events", args.backlog));
    fill(url, &admin, &all[0], args.backlog).await?;
    let alone = Stamping::default();
    let store = PgStore::new(relay_pool()?, all[0].clone());
    let relay = Relay::new(store, alone.clone()).with_config(RelayConfig::default());
    let took = run_while(&relay, alone.wait_for(args.backlog as usize, limit)).await;
    let idle_rate = args.backlog as f64 / took?.as_secs_f64();
    progress(format!("alone on the machine: {idle_rate:.0} events/s"));

    let traffic = format!("{} tenants at {} events/s", tenants - 1, args.rate);
    progress(format!(
        "dedicated relay for tenant 0, the others grouped on another pool: {} events, {traffic}",
        args.backlog
    ));
    let dedicated = phase(url, &admin, &all, args, Layout::Dedicated, &relay_pool).await?;
    progress(format!(
        "dedicated under the same traffic: {:.0} events/s",
        dedicated.big_rate
    ));
    let layout = if args.separate_probes {
        Layout::SeparateProbes
    } else {
        Layout::Group
    };
    progress(format!(
        "{layout:?} of {tenants} on {budget} connections: tenant 0 with {} events, {traffic}",
        args.backlog
    ));
    let shared = phase(url, &admin, &all, args, layout, &relay_pool).await?;
    for tables in &all {
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            tables.schema().quoted()
        ))
        .execute(&admin)
        .await?;
    }

    let p = |millis: &[f64], q: f64| quantile(millis, q);
    let max = shared.millis.last().copied().unwrap_or(0.0);
    let ratio = shared.big_rate / dedicated.big_rate;
    let idle_ratio = shared.big_rate / idle_rate;
    let (p50, p99, warm_p99) = (
        p(&shared.millis, 0.50),
        p(&shared.millis, 0.99),
        p(&shared.warm_millis, 0.99),
    );
    let (dedicated_p99, dedicated_warm_p99) =
        (p(&dedicated.millis, 0.99), p(&dedicated.warm_millis, 0.99));
    Ok(Report {
        line: format!(
            "group{}: {tenants} tenants on {budget} connections; tenant 0's {} events drained at \
             {:.0}/s against {:.0}/s on a dedicated relay under the same traffic ({ratio:.2}; target >= 0.7: {}) \
             and {idle_rate:.0}/s alone on the machine ({idle_ratio:.2}); {} live events of {traffic}: \
             commit-to-publish p50 {p50:.2} ms, p99 {p99:.2} ms (target <= 50: {}), max {max:.1} ms; \
             committed after the first {} s: p99 {warm_p99:.2} ms ({}); with the dedicated relay: \
             p99 {dedicated_p99:.2} ms, after the first {} s {dedicated_warm_p99:.2} ms",
            if args.separate_probes {
                " (separate probes)"
            } else {
                ""
            },
            args.backlog,
            shared.big_rate,
            dedicated.big_rate,
            verdict(ratio >= 0.7),
            shared.millis.len(),
            verdict(p99 <= 50.0),
            WARM_UP.as_secs(),
            verdict(warm_p99 <= 50.0),
            WARM_UP.as_secs(),
        ),
        json: json!({
            "scenario": "group", "separate_probes": args.separate_probes, "tenants": tenants, "connections": budget,
            "backlog": args.backlog, "rate_per_tenant": args.rate, "statement_cache": args.statement_cache,
            "backlog_per_s": shared.big_rate, "dedicated_per_s": dedicated.big_rate, "ratio": ratio,
            "alone_per_s": idle_rate, "ratio_to_alone": idle_ratio,
            "live_events": shared.millis.len(),
            "latency_ms": {"p50": p50, "p99": p99, "max": max},
            "after_warm_up": {"seconds": WARM_UP.as_secs(), "p99_ms": warm_p99},
            "dedicated_latency_ms": {"p99": dedicated_p99, "after_warm_up_p99": dedicated_warm_p99},
        }),
    })
}
