//! Routing rules: which destination (subject, routing key, topic, queue) an event goes to.
//!
//! The same rule for every broker; each adapter validates the resulting names by its
//! own broker's rules.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::event::Event;

/// Chooses a destination for each event. The first that applies wins:
/// 1. the event's own `destination` (set at enqueue);
/// 2. a destination configured for its event type;
/// 3. a destination configured for its aggregate type;
/// 4. the default template, where `{event_type}` and `{aggregate_type}` are replaced
///    by the event's values (e.g. `outbox.{event_type}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    template: String,
    by_event_type: HashMap<String, String>,
    by_aggregate_type: HashMap<String, String>,
}

impl Routing {
    /// Route by `template` unless a rule below applies.
    pub fn new(template: impl Into<String>) -> Self {
        Self {
            template: template.into(),
            by_event_type: HashMap::new(),
            by_aggregate_type: HashMap::new(),
        }
    }

    /// Send events of `event_type` to `destination`.
    #[must_use]
    pub fn event_type(
        mut self,
        event_type: impl Into<String>,
        destination: impl Into<String>,
    ) -> Self {
        self.by_event_type
            .insert(event_type.into(), destination.into());
        self
    }

    /// Send events of `aggregate_type` to `destination` (unless their event type has a rule).
    #[must_use]
    pub fn aggregate_type(
        mut self,
        aggregate_type: impl Into<String>,
        destination: impl Into<String>,
    ) -> Self {
        self.by_aggregate_type
            .insert(aggregate_type.into(), destination.into());
        self
    }

    /// The default template.
    pub fn template(&self) -> &str {
        &self.template
    }

    /// Every configured destination, for validation at build time.
    pub fn configured(&self) -> impl Iterator<Item = &str> {
        self.by_event_type
            .values()
            .chain(self.by_aggregate_type.values())
            .map(String::as_str)
    }

    /// Where `event` goes.
    pub fn destination<'e>(&'e self, event: &'e Event) -> Cow<'e, str> {
        if let Some(d) = &event.destination {
            return Cow::Borrowed(d);
        }
        if let Some(d) = self.by_event_type.get(&event.event_type) {
            return Cow::Borrowed(d);
        }
        if let Some(d) = self.by_aggregate_type.get(&event.aggregate_type) {
            return Cow::Borrowed(d);
        }
        if !self.template.contains('{') {
            return Cow::Borrowed(&self.template);
        }
        Cow::Owned(
            self.template
                .replace("{event_type}", &event.event_type)
                .replace("{aggregate_type}", &event.aggregate_type),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(aggregate_type: &str, event_type: &str) -> Event {
        Event {
            id: uuid::Uuid::now_v7(),
            seq: 1,
            aggregate_type: aggregate_type.into(),
            aggregate_id: "1".into(),
            event_type: event_type.into(),
            payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            headers: Default::default(),
            destination: None,
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    #[test]
    fn rules_apply_in_order() {
        let r = Routing::new("app.{aggregate_type}.{event_type}")
            .event_type("order.paid", "billing")
            .aggregate_type("order", "orders");
        assert_eq!(r.destination(&event("order", "order.paid")), "billing");
        assert_eq!(r.destination(&event("order", "order.created")), "orders");
        assert_eq!(
            r.destination(&event("user", "user.created")),
            "app.user.user.created"
        );
        let mut e = event("order", "order.paid");
        e.destination = Some("special".into());
        assert_eq!(r.destination(&e), "special");
        assert_eq!(Routing::new("fixed").destination(&event("a", "b")), "fixed");
    }
}
