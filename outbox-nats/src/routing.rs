//! Which subject an event is published to.

use pgoutbox_core::{Event, Routing};

use crate::error::{Error, Result};

/// Subject routing rule. For each event, the first that applies wins:
/// 1. the event's `destination` (set at enqueue), used as the subject;
/// 2. a subject configured for its event type ([`SubjectRouting::event_type`]);
/// 3. a subject configured for its aggregate type ([`SubjectRouting::aggregate_type`]);
/// 4. `<prefix>.<event_type>`.
///
/// A resulting subject that is not a valid publish subject (empty token, whitespace,
/// wildcard) makes that event fail permanently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectRouting {
    prefix: String,
    rules: Routing,
}

impl Default for SubjectRouting {
    fn default() -> Self {
        Self::new("outbox")
    }
}

impl SubjectRouting {
    /// Route every event to `<prefix>.<event_type>`. The default prefix is `outbox`.
    pub fn new(prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        let rules = Routing::new(format!("{prefix}.{{event_type}}"));
        Self { prefix, rules }
    }

    /// Publish events of `event_type` to `subject`.
    #[must_use]
    pub fn event_type(mut self, event_type: impl Into<String>, subject: impl Into<String>) -> Self {
        self.rules = self.rules.event_type(event_type, subject);
        self
    }

    /// Publish events of `aggregate_type` to `subject` (unless their event type has a rule).
    #[must_use]
    pub fn aggregate_type(
        mut self,
        aggregate_type: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        self.rules = self.rules.aggregate_type(aggregate_type, subject);
        self
    }

    /// The subject prefix of the default rule.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The subject `event` is published to, validated.
    pub fn subject(&self, event: &Event) -> Result<String, String> {
        let subject = self.rules.destination(event).into_owned();
        validate_subject(&subject)?;
        Ok(subject)
    }

    /// Check the prefix and every configured subject.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_subject(&self.prefix).map_err(|r| Error::config("subject prefix", r))?;
        for subject in self.rules.configured() {
            validate_subject(subject).map_err(|r| Error::config("route", r))?;
        }
        Ok(())
    }
}

/// A valid subject to publish to: dot-separated non-empty tokens, no whitespace or
/// control characters, no wildcard tokens (`*`, `>`).
pub fn validate_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("subject is empty".into());
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "subject `{subject}` contains whitespace or control characters"
        ));
    }
    for token in subject.split('.') {
        match token {
            "" => return Err(format!("subject `{subject}` has an empty token")),
            "*" | ">" => return Err(format!("subject `{subject}` has a wildcard token")),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use pgoutbox_core::conformance::claimed_event;

    use super::*;

    #[test]
    fn rules_apply_in_order() {
        let r = SubjectRouting::new("app")
            .event_type("order.paid", "billing.paid")
            .aggregate_type("order", "orders");
        assert_eq!(
            r.subject(&claimed_event("order", "1", "order.paid", 1))
                .as_deref(),
            Ok("billing.paid")
        );
        assert_eq!(
            r.subject(&claimed_event("order", "1", "order.created", 1))
                .as_deref(),
            Ok("orders")
        );
        assert_eq!(
            r.subject(&claimed_event("user", "1", "user.created", 1))
                .as_deref(),
            Ok("app.user.created")
        );
        let mut e = claimed_event("order", "1", "order.paid", 1);
        e.destination = Some("special.subject".into());
        assert_eq!(r.subject(&e).as_deref(), Ok("special.subject"));
    }

    #[test]
    fn invalid_subjects_are_refused() {
        let r = SubjectRouting::new("app");
        assert!(r
            .subject(&claimed_event("order", "1", "order created", 1))
            .is_err());
        assert!(r
            .subject(&claimed_event("order", "1", "order..created", 1))
            .is_err());
        assert!(r.subject(&claimed_event("order", "1", ">", 1)).is_err());
        assert!(SubjectRouting::new("a.").validate().is_err());
        assert!(SubjectRouting::new("a")
            .event_type("x", "b.*")
            .validate()
            .is_err());
    }
}
