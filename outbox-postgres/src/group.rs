//! Many outboxes relayed by one process: [`RelayGroup`].

use std::future::Future;
use std::sync::Arc;

use pgoutbox_core::{DynPublisher, Relay, RelayConfig};

use crate::shared_wakeup::SharedWakeup;
use crate::store::PgStore;
use crate::wakeup::Wakeup;

/// The relay of one outbox of a [`RelayGroup`].
pub type GroupRelay = Relay<PgStore, Arc<dyn DynPublisher>>;

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
///   so the group never uses more than the pool's `max_connections`.
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

    /// The relays, in the order they were added (their stats, their stores).
    pub fn relays(&self) -> &[GroupRelay] {
        &self.relays
    }

    /// How many pools (databases) the outboxes are on: one shared probe each.
    pub fn databases(&self) -> usize {
        self.wakeups.len()
    }

    /// The outboxes' names (`schema.table`), in the order they were added.
    pub fn names(&self) -> Vec<String> {
        self.relays
            .iter()
            .map(|r| r.store().outbox().tables().outbox_name())
            .collect()
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
