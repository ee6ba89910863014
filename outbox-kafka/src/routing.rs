//! Which topic an event goes to.

use std::borrow::Cow;

use pgoutbox_core::routing::PrefixRouting;
use pgoutbox_core::{Event, PublishError};

use crate::error::{Error, Result};

/// Longest Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;

/// The routing rule, most specific first: the event's destination, a route for its
/// event type, a route for its aggregate type, the fixed default topic, and
/// `<prefix><aggregate_type>` (the shared [`PrefixRouting`], of topics). Collected by
/// [`crate::KafkaConfig`], then [compiled](Routing::compile) into the shared
/// [`pgoutbox_core::Routing`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Routing {
    pub(crate) topics: PrefixRouting,
}

impl Routing {
    /// The rule as used by the publisher. A default topic is validated, so it has no
    /// `{` and is used as is.
    pub(crate) fn compile(&self) -> Topics {
        Topics(self.topics.compile())
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
        let mut routing = Routing::default();
        routing.topics.prefix = "ev.".into();
        let rules = &mut routing.topics.rules;
        rules.insert_aggregate_type("order", "orders".to_string());
        rules.insert_event_type("order.paid", "payments".to_string());
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
