//! Which queue an event goes to.

use pgoutbox_core::routing::PrefixRouting;
use pgoutbox_core::{Event, PublishError};

use crate::error::{Error, Result};

/// The routing rule, most specific first: the event's destination, a route for its
/// event type, a route for its aggregate type, the default queue, and
/// `<prefix><aggregate_type>` (the shared [`PrefixRouting`], of queues). Each target
/// is a queue URL or a queue name.
#[derive(Debug, Clone, Default)]
pub(crate) struct Routing {
    pub(crate) queues: PrefixRouting,
}

/// Where a message goes: a URL as configured, or a name to resolve.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Target {
    Url(String),
    Name(String),
}

impl Routing {
    /// The rule as used by the publisher.
    pub(crate) fn compile(&self) -> Queues {
        Queues {
            default_queue: self.queues.default.clone(),
            rules: self.queues.compile(),
        }
    }
}

/// The compiled routing rule of a publisher (the shared [`pgoutbox_core::Routing`]).
#[derive(Debug, Clone)]
pub(crate) struct Queues {
    pub(crate) default_queue: Option<String>,
    rules: pgoutbox_core::Routing,
}

impl Queues {
    pub(crate) fn target(&self, event: &Event) -> Result<Target, PublishError> {
        let queue = self.rules.destination(event);
        parse_target(&queue).map_err(|e| PublishError::permanent(e.to_string()))
    }
}

/// A queue URL (`http(s)://...`) or a queue name (1 to 80 of `[A-Za-z0-9_-]`, FIFO
/// names ending in `.fifo`).
pub(crate) fn parse_target(queue: &str) -> Result<Target> {
    if queue.starts_with("https://") || queue.starts_with("http://") {
        if queue.contains(char::is_whitespace) {
            return Err(Error::InvalidQueue {
                queue: queue.to_string(),
                reason: "a URL cannot contain whitespace",
            });
        }
        return Ok(Target::Url(queue.to_string()));
    }
    let base = queue.strip_suffix(".fifo").unwrap_or(queue);
    let reason = if queue.len() > 80 {
        "a queue name has at most 80 characters"
    } else if base.is_empty() {
        "empty queue name"
    } else if !base
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        "a queue name has only ASCII letters, digits, `-` and `_` (and a `.fifo` suffix); or give a URL"
    } else {
        return Ok(Target::Name(queue.to_string()));
    };
    Err(Error::InvalidQueue {
        queue: queue.to_string(),
        reason,
    })
}

/// FIFO queues are those whose name (or URL) ends in `.fifo`.
pub(crate) fn is_fifo(url: &str) -> bool {
    url.trim_end_matches('/').ends_with(".fifo")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_parsed() {
        assert_eq!(
            parse_target("orders").unwrap(),
            Target::Name("orders".into())
        );
        assert_eq!(
            parse_target("orders.fifo").unwrap(),
            Target::Name("orders.fifo".into())
        );
        assert!(matches!(
            parse_target("http://h:1/123/q").unwrap(),
            Target::Url(_)
        ));
        assert!(parse_target("bad name").is_err());
        assert!(parse_target(".fifo").is_err());
        assert!(parse_target(&"x".repeat(81)).is_err());
        assert!(is_fifo("http://h/1/q.fifo"));
        assert!(!is_fifo("http://h/1/q"));
    }
}
