//! `outbox relay`: the relay, its HTTP endpoint, the stats gauges and retention
//! cleanup, until SIGTERM or SIGINT.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pgoutbox_core::{Relay, RetentionAdmin, StoreError};
use pgoutbox_postgres::wal::{slot, WalSource, WalStore};
use pgoutbox_postgres::{
    Cleanup, GroupRelay, Member, PgStore, RelayGroup, Retention, TenantDiscovery,
};
use tokio::sync::watch;

use crate::broker::{BrokerPublisher, Prepare, Spec};
use crate::config::{Settings, WalSettings};
use crate::console::{self, Console};
use crate::db::{self, Role};
use crate::exporter;
use crate::failure::Failure;
use crate::history::History;
use crate::http;
use crate::members::Members;
use crate::targets::{self, Pools, Target};
use crate::wal_slot::{self, SlotWatch};

/// Run the relay until a signal, then stop claiming, finish the batches in flight and
/// return, within `relay.shutdown_timeout`.
pub(crate) async fn run(settings: Settings, broker: Spec) -> Result<(), Failure> {
    let mut signals = Signals::watch();
    // Bind first: a taken port or a wrong address fails before anything else starts.
    let listener = match settings.http.listen {
        Some(addr) => Some(http::bind(addr).await?),
        None => None,
    };
    let mut pools = Pools::default();
    let configured = targets::configured(&settings, &mut pools, Role::Relay).await?;
    for target in &configured {
        db::ensure_migrated(&target.pool, &target.tables).await?;
    }
    // The `outbox` label of every series: each outbox's name (`schema.table` by default).
    let names: Vec<String> = configured.iter().map(|t| t.name.clone()).collect();
    let metrics = exporter::install(&names)?;
    let broker_name = broker.name().to_string();
    let publisher = broker.build(Prepare::Yes).await?;
    let relays = if settings.grouped() {
        Relays::group(&settings, &configured, &mut pools, &publisher).await?
    } else {
        Relays::single(&settings, &configured[0], &publisher).await?
    };
    let members = relays.members();
    let wal_watch = relays.wal_watch();

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let console = if settings.console.enabled {
        {
            let history = History::new(settings.console.sample_interval);
            tasks.spawn(console::sample(
                metrics.clone(),
                history.clone(),
                settings.console.sample_interval,
                stop_rx.clone(),
            ));
            Some(Console::new(
                &settings.console,
                members.clone(),
                wal_watch.clone(),
                history,
            )?)
        }
    } else {
        None
    };
    if let Some(listener) = listener {
        let address = listener
            .local_addr()
            .map_err(|e| Failure::runtime(e.to_string()))?;
        tracing::info!(%address, "serving /metrics, /healthz, /readyz");
        if let Some(console) = &console {
            let mode = if console.writable() {
                "retry and purge need the token of console.token_file"
            } else {
                "read-only (no console.token_file)"
            };
            tracing::info!(url = %format!("http://{address}/console/"), mode, "serving the console");
        }
        tasks.spawn(http::serve(
            listener,
            metrics.clone(),
            pools.all(),
            Arc::clone(&publisher),
            http::Probes {
                check_timeout: settings.http.check_timeout,
                stuck_after: settings.http.stuck_after,
                members: members.clone(),
                wal: wal_watch.clone(),
            },
            console,
            stopped(stop_rx.clone()),
        ));
    }
    tasks.spawn(upkeep(metrics, stop_rx.clone()));
    tasks.spawn(refresh_stats(
        members.clone(),
        wal_watch,
        settings.http.stats_refresh,
        stop_rx.clone(),
    ));
    if matches!(settings.retention.published, Retention::Keep(_))
        || settings.retention.inbox.is_some()
    {
        tasks.spawn(clean_periodically(
            members.clone(),
            settings.retention,
            stop_rx.clone(),
        ));
    }

    tracing::info!(
        broker = %broker_name,
        outboxes = %names.join(", "),
        tenants = settings.tenants.as_ref().map(|t| t.pattern.as_str()).unwrap_or("-"),
        batch_size = settings.relay.batch_size,
        workers = settings.relay.workers,
        ordering = settings.store.ordering,
        "outbox relay started"
    );
    // Boxed, not pinned on the stack, so that it can be dropped (claims released) below.
    let mut relay_run = Box::pin(relays.run(stop_rx.clone()));
    let signal = tokio::select! {
        () = &mut relay_run => "relay stopped",
        signal = signals.next() => signal,
    };
    let limit = settings.shutdown_timeout;
    tracing::info!(
        %signal,
        timeout = %humantime::format_duration(limit),
        "shutting down: no new claims; finishing batches in flight"
    );
    let _ = stop_tx.send(true);
    let finished = tokio::select! {
        done = tokio::time::timeout(limit, &mut relay_run) => done.is_ok(),
        signal = signals.next() => {
            tracing::warn!(%signal, "second signal: stopping at once");
            false
        }
    };
    // Dropping an unfinished relay drops its claims: their transactions roll back and
    // the events are claimed again by the next relay (published at least once).
    drop(relay_run);
    drop(relays);
    drop(members);
    let stats_tasks = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(5), stats_tasks)
        .await
        .is_err()
    {
        tracing::warn!("background tasks did not stop within 5 s");
    }
    if tokio::time::timeout(Duration::from_secs(5), pools.close())
        .await
        .is_err()
    {
        tracing::warn!("database connections did not close within 5 s");
    }
    if finished {
        tracing::info!("outbox relay stopped cleanly");
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "shutdown did not finish within {} (relay.shutdown_timeout): unfinished batches were rolled back and will be published again",
            humantime::format_duration(limit)
        )))
    }
}

/// The relays of the process.
enum Relays {
    /// `[tables]`'s outbox (and in WAL mode the slot's relay next to it, which
    /// parks failed events in that table, with its view of the slot).
    Single {
        relay: Box<GroupRelay>,
        wal: Option<(Box<Relay<WalStore, BrokerPublisher>>, SlotWatch)>,
    },
    /// `[[outbox]]` and `[tenants]`: one relay per outbox, a shared wake-up probe
    /// and a pool per database.
    Group {
        group: RelayGroup,
        tenants: Option<Arc<TenantDiscovery>>,
    },
}

impl Relays {
    async fn single(
        settings: &Settings,
        target: &Target,
        publisher: &BrokerPublisher,
    ) -> Result<Self, Failure> {
        let store = PgStore::new(target.pool.clone(), target.tables.clone())
            .with_config(settings.store)
            .with_wakeup(settings.wakeup.clone());
        let relay = Relay::new(store, Arc::clone(publisher)).with_config(target.relay.clone());
        // WAL mode: a second relay reads the slot; the first drains what it parks.
        let wal = match &settings.wal {
            Some(wal) => Some(wal_relay(target, settings, wal, Arc::clone(publisher)).await?),
            None => None,
        };
        Ok(Self::Single {
            relay: Box::new(relay),
            wal: wal.map(|(relay, watch)| (Box::new(relay), watch)),
        })
    }

    async fn group(
        settings: &Settings,
        configured: &[Target],
        pools: &mut Pools,
        publisher: &BrokerPublisher,
    ) -> Result<Self, Failure> {
        let mut group = RelayGroup::new();
        for target in configured {
            let store = PgStore::new(target.pool.clone(), target.tables.clone())
                .with_config(settings.store);
            group.add_named(
                target.name.clone(),
                store,
                Arc::clone(publisher),
                target.relay.clone(),
            );
        }
        let tenants = match &settings.tenants {
            Some(tenants) => {
                let pool = pools.of(settings.database()?, None, Role::Relay).await?;
                Some(Arc::new(
                    TenantDiscovery::new(pool, tenants.pattern.clone(), Arc::clone(publisher))
                        .events_table(tenants.events_table.clone())
                        .interval(tenants.interval)
                        .relay_config(tenants.relay.clone())
                        .store_config(settings.store),
                ))
            }
            None => None,
        };
        Ok(Self::Group { group, tenants })
    }

    fn members(&self) -> Members {
        match self {
            Self::Single { relay, .. } => Members::new(vec![Member::of(relay)], None),
            Self::Group { group, tenants } => Members::new(group.members(), tenants.clone()),
        }
    }

    /// The WAL outbox's slot, in WAL mode.
    fn wal_watch(&self) -> Option<SlotWatch> {
        match self {
            Self::Single {
                wal: Some((_, watch)),
                ..
            } => Some(watch.clone()),
            _ => None,
        }
    }

    /// Relay until `stop` turns true; each relay then finishes its batches in flight.
    async fn run(&self, stop: watch::Receiver<bool>) {
        match self {
            Self::Single { relay, wal } => {
                let wal_run = async {
                    if let Some((wal, _)) = wal {
                        wal.run(stopped(stop.clone())).await;
                    }
                };
                tokio::join!(relay.run(stopped(stop.clone())), wal_run);
            }
            Self::Group { group, tenants } => {
                let tenants_run = async {
                    if let Some(tenants) = tenants {
                        tenants.run(stopped(stop.clone())).await;
                    }
                };
                tokio::join!(group.run(stopped(stop.clone())), tenants_run);
            }
        }
    }
}

/// The relay of the WAL outbox and its view of the slot. A slot that cannot
/// carry the outbox's events (missing: `outbox migrate` creates it; another
/// database's; ...) does not stop the relay: it reports not ready until the slot
/// can (its reader retries meanwhile), and the table relay drains parked events.
async fn wal_relay(
    target: &Target,
    settings: &Settings,
    wal: &WalSettings,
    publisher: BrokerPublisher,
) -> Result<(Relay<WalStore, BrokerPublisher>, SlotWatch), Failure> {
    let database = settings.database()?;
    let pool = &target.pool;
    slot::check_wal_level(pool)
        .await
        .map_err(|e| Failure::config(e.to_string()))?;
    let slot = wal_slot::resolve(pool, &target.tables, wal).await?;
    let watch = SlotWatch::new(pool.clone(), slot.clone(), target.name.clone());
    // Logged (and counted) now when the slot cannot carry the outbox.
    if let Err(error) = watch.problem().await {
        tracing::warn!(%slot, %error, "cannot check the WAL outbox's slot");
    }
    let url = wal.replication_url.as_deref().unwrap_or(&database.url);
    let mut source = WalSource::new(url, slot.as_str(), wal.publication.as_str());
    if let (None, Some(path)) = (&wal.replication_url, &database.password_file) {
        source.password = Some(db::read_password(path)?);
    }
    tracing::info!(
        %slot,
        note = wal_slot::former_note(&target.tables, &slot),
        "WAL outbox: reading the slot; parked events drain from the table"
    );
    let store = WalStore::new(pool.clone(), target.tables.clone(), source);
    // One claim at a time: the stream's order is the publish order.
    let relay = Relay::new(store, publisher).with_config(settings.relay.clone().workers(1));
    Ok((relay, watch))
}

/// Resolves once `stop` turns true.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// SIGTERM and SIGINT, watched from the start of the command: a signal that
/// arrives while the relay is still starting stops it cleanly too (instead of
/// killing the process with the default action).
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn watch() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let watch = |kind: SignalKind, name: &str| {
                signal(kind)
                    .map_err(|error| tracing::warn!(%error, "cannot watch {name}"))
                    .ok()
            };
            Self {
                term: watch(SignalKind::terminate(), "SIGTERM"),
                int: watch(SignalKind::interrupt(), "SIGINT"),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// The name of the next SIGTERM or SIGINT received.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
                match signal {
                    Some(signal) => {
                        signal.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                () = recv(&mut self.term) => "SIGTERM",
                () = recv(&mut self.int) => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// Run `tick` every `period` (first after one period) until `stop` turns true. A
/// tick in progress runs to its end: `stop` is looked at between ticks.
async fn every<F: Future<Output = ()>>(
    period: Duration,
    stop: watch::Receiver<bool>,
    mut tick: impl FnMut() -> F,
) {
    let stop = stopped(stop);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return,
            () = tokio::time::sleep(period) => {}
        }
        tick().await;
    }
}

/// Keep the exporter's histograms drained while nobody scrapes.
async fn upkeep(
    metrics: metrics_exporter_prometheus::PrometheusHandle,
    stop: watch::Receiver<bool>,
) {
    every(Duration::from_secs(5), stop, || async {
        metrics.run_upkeep()
    })
    .await;
}

/// Dead letters and oldest pending age of each outbox, for alerts: now, then
/// every `period`.
async fn refresh_stats(
    members: Members,
    wal: Option<SlotWatch>,
    period: Duration,
    stop: watch::Receiver<bool>,
) {
    let refresh = || refresh_stats_once(&members, wal.as_ref());
    refresh().await;
    every(period, stop, refresh).await;
}

/// One refresh of the stats gauges of every outbox (and of the WAL outbox's slot).
async fn refresh_stats_once(members: &Members, wal: Option<&SlotWatch>) {
    for member in members.now() {
        let outbox = member.name;
        match member.store.stats().await {
            Ok(stats) => {
                metrics::gauge!(exporter::DEAD_LETTERS, "outbox" => outbox.clone())
                    .set(stats.dead_letters as f64);
                metrics::gauge!(exporter::OLDEST_PENDING_AGE, "outbox" => outbox.clone())
                    .set(stats.oldest_pending_age.as_secs_f64());
            }
            Err(error) => tracing::warn!(%error, %outbox, "cannot read outbox stats"),
        }
        match member.store.horizon().await {
            Ok(horizon) => {
                let seconds = |age: Option<Duration>| age.unwrap_or_default().as_secs_f64();
                metrics::gauge!(exporter::OLDEST_SNAPSHOT_AGE, "outbox" => outbox.clone())
                    .set(seconds(horizon.oldest_snapshot_age));
                metrics::gauge!(exporter::PRODUCER_TRANSACTION_AGE, "outbox" => outbox.clone())
                    .set(seconds(horizon.oldest_producer_age));
            }
            Err(error) => tracing::warn!(%error, %outbox, "cannot read the xmin horizon"),
        }
    }
    if let Some(wal) = wal {
        if let Err(error) = wal.problem().await {
            tracing::warn!(slot = %wal.slot, %error, "cannot check the WAL outbox's slot");
        }
        match slot::lag_bytes(&wal.pool, &wal.slot).await {
            Ok(Some(bytes)) => {
                metrics::gauge!(exporter::WAL_SLOT_LAG, "outbox" => wal.outbox.clone())
                    .set(bytes as f64);
            }
            // Reported by the check above.
            Ok(None) => {}
            Err(error) => tracing::warn!(%error, "cannot read the WAL slot's lag"),
        }
    }
}

/// Retention: delete published rows and inbox records past their age, outbox by
/// outbox, every `retention.cleanup_interval`.
async fn clean_periodically(
    members: Members,
    retention: crate::config::RetentionSettings,
    stop: watch::Receiver<bool>,
) {
    every(retention.cleanup_interval, stop, || {
        clean_all(&members, &retention)
    })
    .await;
}

/// One retention pass over every outbox.
async fn clean_all(members: &Members, retention: &crate::config::RetentionSettings) {
    for member in members.now() {
        let cleanup = Cleanup::new(member.store.pool().clone(), member.store.outbox())
            .with_batch_size(retention.cleanup_batch_size);
        let outbox = member.name;
        match clean_once(&cleanup, &outbox, retention).await {
            Ok((events, inbox)) if events + inbox > 0 => {
                tracing::info!(events, inbox, %outbox, "retention cleanup deleted rows");
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, %outbox, "retention cleanup failed; retrying later");
            }
        }
    }
}

/// One retention pass: (published rows deleted, inbox records deleted).
/// `outbox` names the outbox in the deletion counter's label.
pub(crate) async fn clean_once(
    cleanup: &impl RetentionAdmin,
    outbox: &str,
    retention: &crate::config::RetentionSettings,
) -> Result<(u64, u64), StoreError> {
    let events = match retention.published {
        Retention::Keep(age) => cleanup.delete_published_older_than(age).await?,
        Retention::Delete => 0,
    };
    let inbox = match retention.inbox {
        Some(age) => cleanup.delete_inbox_older_than(age).await?,
        None => 0,
    };
    metrics::counter!(exporter::CLEANUP_DELETED, "outbox" => outbox.to_string())
        .increment(events + inbox);
    Ok((events, inbox))
}
