//! Where the outbox lives: schema, table, view and index names.

use crate::error::Result;
use crate::ident::Ident;

/// Longest events table name: leaves room for the derived index names.
const MAX_EVENTS_NAME_LEN: usize = 48;

/// The names of the outbox objects, validated.
///
/// Defaults (the names of the pattern): schema `public`, table `outbox_events`,
/// view `outbox_dead_letters`, inbox `processed_events`. Several outboxes can share a
/// database, one per schema (multi-tenant) or one per table name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    schema: Ident,
    events: Ident,
    dead_letters: Ident,
    inbox: Ident,
}

impl Default for Tables {
    fn default() -> Self {
        Self::build("public", "outbox_events", "processed_events")
            .unwrap_or_else(|_| unreachable!("the default names are valid"))
    }
}

impl Tables {
    /// Outbox objects in `schema`, with the default names.
    pub fn in_schema(schema: &str) -> Result<Self> {
        Self::build(schema, "outbox_events", "processed_events")
    }

    /// Use `name` for the events table (at most 48 bytes). The dead-letter view is
    /// derived from it: `x_events` gives `x_dead_letters`, any other `t` gives
    /// `t_dead_letters`.
    pub fn with_events_table(self, name: &str) -> Result<Self> {
        Self::build(self.schema.as_str(), name, self.inbox.as_str())
    }

    /// Use `name` for the consumer inbox table.
    pub fn with_inbox_table(self, name: &str) -> Result<Self> {
        Self::build(self.schema.as_str(), self.events.as_str(), name)
    }

    fn build(schema: &str, events: &str, inbox: &str) -> Result<Self> {
        let events_ident = Ident::new("events table", events)?;
        if events.len() > MAX_EVENTS_NAME_LEN {
            return Err(crate::Error::InvalidIdentifier {
                what: "events table",
                value: events.to_string(),
                reason: format!(
                    "it is {} bytes long; the limit is {MAX_EVENTS_NAME_LEN} (index names are derived from it)",
                    events.len()
                ),
            });
        }
        let stem = events.strip_suffix("_events").unwrap_or(events);
        Ok(Self {
            schema: Ident::new("schema", schema)?,
            dead_letters: Ident::new("dead letters view", &format!("{stem}_dead_letters"))?,
            events: events_ident,
            inbox: Ident::new("inbox table", inbox)?,
        })
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The events table name (unqualified).
    pub fn events(&self) -> &Ident {
        &self.events
    }

    /// The dead-letter view name (unqualified).
    pub fn dead_letters(&self) -> &Ident {
        &self.dead_letters
    }

    /// The inbox table name (unqualified).
    pub fn inbox(&self) -> &Ident {
        &self.inbox
    }

    /// The outbox's name in metrics and logs: `schema.events_table`, unquoted.
    pub fn outbox_name(&self) -> String {
        format!("{}.{}", self.schema, self.events)
    }

    /// The function the SQL emit function asks whether this database may emit an
    /// event now (migration 8; `wal::slot::guard_emit_function`), qualified.
    pub(crate) fn emit_check_function(&self) -> String {
        format!(
            "{}.{}",
            self.schema.quoted(),
            self.derived(&self.events, "emit_check")
        )
    }

    /// The SQL function that emits a WAL-mode event (migration 8), qualified and
    /// quoted: `"schema"."<events>_emit"` (docs/sql-contract.md).
    pub fn emit_function(&self) -> String {
        format!(
            "{}.{}",
            self.schema.quoted(),
            self.derived(&self.events, "emit")
        )
    }

    /// `"schema"."name"`.
    pub(crate) fn qualify(&self, name: &Ident) -> String {
        format!("{}.{}", self.schema.quoted(), name.quoted())
    }

    /// An object name derived from a table name plus a suffix, quoted.
    pub(crate) fn derived(&self, base: &Ident, suffix: &str) -> String {
        // Bases are validated and short enough (events <= 48, inbox checked at use).
        let mut name = format!("{base}_{suffix}");
        name.truncate(crate::ident::MAX_IDENT_LEN);
        format!("\"{name}\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_pattern_names() {
        let t = Tables::default();
        assert_eq!(t.qualify(t.events()), "\"public\".\"outbox_events\"");
        assert_eq!(t.dead_letters().as_str(), "outbox_dead_letters");
        assert_eq!(t.inbox().as_str(), "processed_events");
    }

    #[test]
    fn derived_names() {
        let t = Tables::in_schema("tenant_a")
            .unwrap()
            .with_events_table("billing")
            .unwrap();
        assert_eq!(t.dead_letters().as_str(), "billing_dead_letters");
        assert_eq!(
            t.derived(t.events(), "pending_idx"),
            "\"billing_pending_idx\""
        );
    }

    #[test]
    fn bad_names_are_named_in_the_error() {
        let err = Tables::in_schema("Tenant").unwrap_err().to_string();
        assert!(err.starts_with("invalid schema name \"Tenant\""), "{err}");
        let err = Tables::default()
            .with_events_table("x;drop")
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid events table name"), "{err}");
        let err = Tables::default()
            .with_events_table(&"e".repeat(50))
            .unwrap_err()
            .to_string();
        assert!(err.contains("limit is 48"), "{err}");
    }
}
