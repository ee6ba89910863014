//! The outboxes a running relay process serves, as its health endpoints, stats
//! gauges and retention cleanup see them: fixed at start (`[tables]`, `[[outbox]]`)
//! plus the `[tenants]` relayed at the moment.

use std::sync::Arc;

use pgoutbox_postgres::{Member, TenantDiscovery};

/// A source of the outboxes relayed now.
#[derive(Clone)]
pub(crate) struct Members {
    fixed: Vec<Member>,
    tenants: Option<Arc<TenantDiscovery>>,
}

impl Members {
    pub(crate) fn new(fixed: Vec<Member>, tenants: Option<Arc<TenantDiscovery>>) -> Self {
        Self { fixed, tenants }
    }

    /// Every outbox relayed now.
    pub(crate) fn now(&self) -> Vec<Member> {
        let mut all = self.fixed.clone();
        if let Some(tenants) = &self.tenants {
            all.extend(tenants.members());
        }
        all
    }

    /// The names of the `[tenants]` outboxes relayed now.
    pub(crate) fn tenant_names(&self) -> std::collections::HashSet<String> {
        self.tenants
            .iter()
            .flat_map(|tenants| tenants.members())
            .map(|member| member.name)
            .collect()
    }

    /// Whether the process relays (or may relay) more than one outbox: its
    /// reports then name the outbox.
    pub(crate) fn several(&self) -> bool {
        self.fixed.len() > 1 || self.tenants.is_some()
    }
}
