//! Which topic an event goes to.

use std::borrow::Cow;
use std::collections::BTreeMap;

use pgoutbox_core::{Event, PublishError};

use crate::error::{Error, Result};

/// Longest Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;

/// The routing rule, most specific first: the event's destination, a route for its
/// event type, a route for its aggregate type, the fixed default topic, and
/// `<prefix><aggregate_type>`. Collected by [`crate::KafkaConfig`], then
/// [compiled](Routing::compile) into the shared [`pgoutbox_core::Routing`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Routing {
    pub(crate) prefix: String,
    pub(crate) default_topic: Option<String>,
    pub(crate) by_aggregate_type: BTreeMap<String, String>,
    pub(crate) by_event_type: BTreeMap<String, String>,
}

impl Routing {
    /// The rule as used by the publisher.
    pub(crate) fn compile(&self) -> Topics {
        // A default topic is validated, so it has no `{` and is used as is.
        let template = match &self.default_topic {
            Some(topic) => topic.clone(),
            None => format!("{}{{aggregate_type}}", self.prefix),
        };
        let mut rules = pgoutbox_core::Routing::new(template);
        for (aggregate_type, topic) in &self.by_aggregate_type {
            rules = rules.aggregate_type(aggregate_type, topic);
        }
        for (event_type, topic) in &self.by_event_type {
            rules = rules.event_type(event_type, topic);
        }
        Topics(rules)
    }
}

/// The compiled routing rule of a publisher.
#[derive(Debug, Clone)]
pub(crate) struct Topics(pgoutbox_core::Routing);

impl Topics {
    /// The topic of `event`; an invalid name is a permanent failure of that event.
    pub(crate) fn topic<'a>(&'a self, event: &'a Event) -> Result<Cow<'a, str>, PublishError> {
        let topic = self.0.destination(event);
        validate_topic(&topic).map_err(|e| PublishError::permanent(e.to_string()))?;
        Ok(topic)
    }
}

/// Kafka's rule: 1 to 249 characters of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(crate) fn validate_topic(topic: &str) -> Result<()> {
    let reason = if topic.is_empty() {
        "empty"
    } else if topic.len() > MAX_TOPIC_LEN {
        "longer than 249 characters"
    } else if topic == "." || topic == ".." {
        "`.` and `..` are not allowed"
    } else if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        "only ASCII letters, digits, `.`, `_` and `-` are allowed"
    } else {
        return Ok(());
    };
    Err(Error::InvalidTopic {
        topic: topic.to_string(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(aggregate_type: &str, event_type: &str, destination: Option<&str>) -> Event {
        let payload = serde_json::value::RawValue::from_string("{}".into()).unwrap();
        let mut event = Event::new(
            uuid::Uuid::now_v7(),
            aggregate_type,
            "1",
            event_type,
            payload,
            chrono::Utc::now(),
        );
        event.destination = destination.map(Into::into);
        event
    }

    #[test]
    fn most_specific_route_wins() {
        let mut routing = Routing {
            prefix: "ev.".into(),
            ..Routing::default()
        };
        routing
            .by_aggregate_type
            .insert("order".into(), "orders".into());
        routing
            .by_event_type
            .insert("order.paid".into(), "payments".into());
        let routing = routing.compile();
        let topic = |e: &Event| routing.topic(e).map(|t| t.into_owned());
        assert_eq!(
            topic(&event("user", "user.created", None)).unwrap(),
            "ev.user"
        );
        assert_eq!(
            topic(&event("order", "order.created", None)).unwrap(),
            "orders"
        );
        assert_eq!(
            topic(&event("order", "order.paid", None)).unwrap(),
            "payments"
        );
        assert_eq!(
            topic(&event("order", "order.paid", Some("audit"))).unwrap(),
            "audit"
        );
        let err = topic(&event("order", "x", Some("bad topic"))).unwrap_err();
        assert!(!err.is_retryable());
    }
}
