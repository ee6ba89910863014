//! Many outboxes relayed by one process: [`RelayGroup`].

use std::future::Future;
use std::sync::Arc;

use pgoutbox_core::{BrokerHealth, DynPublisher, Liveness, Relay, RelayConfig};

use crate::shared_wakeup::SharedWakeup;
use crate::store::PgStore;
use crate::wakeup::Wakeup;

/// The relay of one outbox of a [`RelayGroup`].
pub type GroupRelay = Relay<PgStore, Arc<dyn DynPublisher>>;

/// One running outbox of a [`RelayGroup`] or a [`TenantDiscovery`], as a process
/// serving them reports on it: its name (the `outbox` label), its store (for
/// stats and retention) and its relay's health.
#[derive(Clone, Debug)]
pub struct Member {
    /// The outbox's name in metrics and logs.
    pub name: String,
    /// Its store.
    pub store: PgStore,
    /// When each of its claim loops last finished a cycle.
    pub liveness: Arc<Liveness>,
    /// Whether its relay is in a broker outage.
    pub broker_health: Arc<BrokerHealth>,
}

impl Member {
    /// What a process reports on about `relay`.
    pub fn of(relay: &GroupRelay) -> Self {
        Self {
            name: relay.name().to_string(),
            store: relay.store().clone(),
            liveness: relay.liveness(),
            broker_health: relay.broker_health(),
        }
    }
}

/// The schemas of the database that match `pattern` (SQL `LIKE`) and hold a table
/// named `events_table`, sorted: the tenants a [`TenantDiscovery`] would relay now.
pub async fn tenant_schemas(
    pool: &sqlx::PgPool,
    pattern: &str,
    events_table: &str,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(crate::sql::DISCOVER_SCHEMAS)
        .bind(pattern)
        .bind(events_table)
        .fetch_all(pool)
        .await
}

/// Many outboxes relayed by one process: schemas or tables of tenants, in one
/// database or several.
///
/// Each outbox keeps its own relay (its own routing, publisher, retry and
/// hold-back state, per-aggregate order, metrics labelled with its name); what
/// the group adds is what many relays must share:
/// - **One wake-up per database**: the stores on one pool share a
///   [`SharedWakeup`], so idle outboxes cost one probe statement per interval
///   between them, not one each.
/// - **A connection budget per database**: the pool. Every claim holds one of its
///   connections for the whole publish and the shared probe takes one at a time,
///   so the group never uses more than the pool's `max_connections`. Give the
///   pool a statement cache for every outbox's statements
///   (`PgConnectOptions::statement_cache_capacity`, e.g. 1000 for 50 outboxes;
///   sqlx's default is 100): each outbox's statements are its own, and evicted
///   ones are parsed and planned again on every claim.
/// - **Fairness**: each outbox claims one batch at a time (its relay's
///   `workers`, 1 by default), and sqlx hands the pool's connections out in the
///   order they were asked for, so an outbox with a large backlog takes one
///   connection in turn with the others and cannot starve them.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, publisher: std::sync::Arc<dyn pgoutbox_core::DynPublisher>)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// use pgoutbox_core::RelayConfig;
/// use pgoutbox_postgres::{PgStore, RelayGroup, Tables};
///
/// let mut group = RelayGroup::new();
/// for tenant in ["tenant_a", "tenant_b"] {
///     let store = PgStore::new(pool.clone(), Tables::in_schema(tenant)?);
///     group.add(store, publisher.clone(), RelayConfig::default());
/// }
/// group.run(tokio::signal::ctrl_c()).await;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct RelayGroup {
    /// One shared wake-up per pool (database), found by the pool's identity.
    wakeups: Vec<(sqlx::PgPool, SharedWakeup)>,
    relays: Vec<GroupRelay>,
}

impl std::fmt::Debug for RelayGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayGroup")
            .field("outboxes", &self.names())
            .field("databases", &self.databases())
            .finish()
    }
}

impl RelayGroup {
    /// An empty group.
    pub fn new() -> Self {
        Self::default()
    }

    /// Relay `store`'s outbox to `publisher` with `config`. The store's wake-up
    /// becomes the [`SharedWakeup`] of its pool: stores on clones of one pool
    /// share it (give the outboxes of one database one pool: it is their
    /// connection budget).
    pub fn add(
        &mut self,
        store: PgStore,
        publisher: Arc<dyn DynPublisher>,
        config: RelayConfig,
    ) -> &mut Self {
        let wakeup = self.wakeup_of(store.pool());
        let store = store.with_wakeup(Wakeup::Shared(wakeup));
        self.relays
            .push(Relay::new(store, publisher).with_config(config));
        self
    }

    /// [`add`](Self::add), with the outbox named `name` in metrics and logs
    /// instead of `schema.table` (two databases may both hold `public.outbox_events`).
    pub fn add_named(
        &mut self,
        name: impl Into<String>,
        store: PgStore,
        publisher: Arc<dyn DynPublisher>,
        config: RelayConfig,
    ) -> &mut Self {
        self.add(store, publisher, config);
        if let Some(relay) = self.relays.pop() {
            self.relays.push(relay.with_name(name));
        }
        self
    }

    /// Each outbox's name, store and health, in the order they were added.
    pub fn members(&self) -> Vec<Member> {
        self.relays.iter().map(Member::of).collect()
    }

    /// The relays, in the order they were added (their stats, their stores).
    pub fn relays(&self) -> &[GroupRelay] {
        &self.relays
    }

    /// How many pools (databases) the outboxes are on: one shared probe each.
    pub fn databases(&self) -> usize {
        self.wakeups.len()
    }

    /// The outboxes' names (`schema.table` or the name given to
    /// [`add_named`](Self::add_named)), in the order they were added.
    pub fn names(&self) -> Vec<String> {
        self.relays.iter().map(|r| r.name().to_string()).collect()
    }

    /// Run every relay until `shutdown` completes; each finishes its batches in
    /// flight, as [`Relay::run`] does.
    pub async fn run(&self, shutdown: impl Future<Output = impl Sized> + Send) {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let relays = futures_util::future::join_all(self.relays.iter().map(|relay| {
            let mut stopped = stopped.clone();
            relay.run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            })
        }));
        let signal = async {
            shutdown.await;
            let _ = stop.send(true);
        };
        tokio::pin!(relays);
        tokio::select! {
            _ = &mut relays => return,
            () = signal => {}
        }
        relays.await;
    }

    fn wakeup_of(&mut self, pool: &sqlx::PgPool) -> SharedWakeup {
        // Clones of one pool share its options; another pool has its own.
        let options = pool.connect_options();
        if let Some((_, wakeup)) = self
            .wakeups
            .iter()
            .find(|(p, _)| Arc::ptr_eq(&p.connect_options(), &options))
        {
            return wakeup.clone();
        }
        let wakeup = SharedWakeup::new(pool.clone());
        self.wakeups.push((pool.clone(), wakeup.clone()));
        wakeup
    }
}

/// Relays for every tenant schema of a database, found by name while they run:
/// each schema whose name matches a `LIKE` pattern (e.g. `tenant\_%`) and holds
/// the events table gets a relay within one discovery interval of its creation
/// (migrate it first), and a schema that is dropped has its relay stopped. The
/// relays share one wake-up probe and the pool, as in a [`RelayGroup`].
pub struct TenantDiscovery {
    pool: sqlx::PgPool,
    pattern: String,
    events_table: String,
    interval: std::time::Duration,
    publisher: Arc<dyn DynPublisher>,
    relay_config: RelayConfig,
    store_config: crate::store::StoreConfig,
    /// The tenants relayed now, by schema.
    running: Arc<std::sync::Mutex<std::collections::BTreeMap<String, Member>>>,
}

impl std::fmt::Debug for TenantDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantDiscovery")
            .field("pattern", &self.pattern)
            .field("events_table", &self.events_table)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// One discovered tenant's relay task and how to stop it.
struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    member: Member,
}

impl TenantDiscovery {
    /// Tenants in the schemas matching `pattern` (SQL `LIKE`), each with the default
    /// table names, published with `publisher`; looked for every 30 s.
    pub fn new(
        pool: sqlx::PgPool,
        pattern: impl Into<String>,
        publisher: Arc<dyn DynPublisher>,
    ) -> Self {
        Self {
            pool,
            pattern: pattern.into(),
            events_table: crate::tables::Tables::default()
                .events()
                .as_str()
                .to_string(),
            interval: std::time::Duration::from_secs(30),
            publisher,
            relay_config: RelayConfig::default(),
            store_config: crate::store::StoreConfig::default(),
            running: Arc::default(),
        }
    }

    /// The events table each tenant schema holds (and is found by). Defaults to
    /// `outbox_events`; an invalid name is an error of [`run`](Self::run)'s relays,
    /// logged per schema.
    #[must_use]
    pub fn events_table(mut self, name: impl Into<String>) -> Self {
        self.events_table = name.into();
        self
    }

    /// Look for new and dropped schemas this often. Defaults to 30 s.
    #[must_use]
    pub fn interval(mut self, interval: std::time::Duration) -> Self {
        self.interval = interval;
        self
    }

    /// The relays' configuration. Defaults to [`RelayConfig::default`].
    #[must_use]
    pub fn relay_config(mut self, config: RelayConfig) -> Self {
        self.relay_config = config;
        self
    }

    /// The stores' configuration. Defaults to [`crate::StoreConfig::default`].
    #[must_use]
    pub fn store_config(mut self, config: crate::store::StoreConfig) -> Self {
        self.store_config = config;
        self
    }

    /// The schemas relayed now, sorted.
    pub fn tenants(&self) -> Vec<String> {
        self.running
            .lock()
            .map(|r| r.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Each tenant relayed now: its name, store and health, sorted by schema.
    pub fn members(&self) -> Vec<Member> {
        self.running
            .lock()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Discover and relay until `shutdown` completes; then every relay finishes
    /// its batches in flight. A failed look (the database unreachable) is logged
    /// and tried again at the next interval; the relays found so far go on.
    pub async fn run(&self, shutdown: impl Future<Output = impl Sized> + Send) {
        let wakeup = SharedWakeup::new(self.pool.clone());
        let mut relays: std::collections::BTreeMap<String, Running> = Default::default();
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = &mut shutdown => break,
            }
            let found = match tenant_schemas(&self.pool, &self.pattern, &self.events_table).await {
                Ok(found) => found,
                Err(error) => {
                    tracing::warn!(%error, pattern = %self.pattern, "tenant discovery failed; trying again");
                    continue;
                }
            };
            let gone: Vec<String> = relays
                .keys()
                .filter(|schema| !found.contains(schema))
                .cloned()
                .collect();
            for schema in gone {
                if let Some(running) = relays.remove(&schema) {
                    let _ = running.stop.send(true);
                    let _ = running.task.await;
                    tracing::info!(%schema, "tenant outbox gone: its relay stopped");
                }
            }
            for schema in found {
                if relays.contains_key(&schema) {
                    continue;
                }
                let tables = match crate::tables::Tables::in_schema(&schema)
                    .and_then(|t| t.with_events_table(&self.events_table))
                {
                    Ok(tables) => tables,
                    Err(error) => {
                        tracing::warn!(%error, %schema, "tenant schema skipped");
                        continue;
                    }
                };
                let store = PgStore::new(self.pool.clone(), tables)
                    .with_config(self.store_config)
                    .with_wakeup(Wakeup::Shared(wakeup.clone()));
                let relay = Relay::new(store, Arc::clone(&self.publisher))
                    .with_config(self.relay_config.clone());
                let member = Member::of(&relay);
                let (stop, mut stopped) = tokio::sync::watch::channel(false);
                let task = tokio::spawn(async move {
                    relay
                        .run(async move {
                            let _ = stopped.wait_for(|stop| *stop).await;
                        })
                        .await;
                });
                tracing::info!(%schema, "tenant outbox found: relaying it");
                relays.insert(schema, Running { stop, task, member });
            }
            if let Ok(mut running) = self.running.lock() {
                *running = relays
                    .iter()
                    .map(|(schema, r)| (schema.clone(), r.member.clone()))
                    .collect();
            }
        }
        for running in relays.values() {
            let _ = running.stop.send(true);
        }
        for (_, running) in relays {
            let _ = running.task.await;
        }
        if let Ok(mut running) = self.running.lock() {
            running.clear();
        }
    }
}
