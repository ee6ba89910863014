//! Which exchange and routing key an event is published with.

use pgoutbox_core::routing::RouteTable;
use pgoutbox_core::Event;

use crate::error::{Error, Result};

/// Longest routing key or exchange name AMQP 0.9.1 carries (a short string).
pub const MAX_SHORT_STRING: usize = 255;

/// Where one message goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The exchange (`""` is the default exchange, routing by queue name).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
}

impl Route {
    fn new(exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }
    }
}

/// Routing rule. For each event, the first that applies wins:
/// 1. the event's `destination` (set at enqueue): routing key on the default exchange
///    of this rule;
/// 2. a route configured for its event type ([`AmqpRouting::event_type`]);
/// 3. a route configured for its aggregate type ([`AmqpRouting::aggregate_type`]);
/// 4. the rule's exchange with routing key = event type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpRouting {
    exchange: String,
    routes: RouteTable<Route>,
}

impl Default for AmqpRouting {
    fn default() -> Self {
        Self::new("outbox")
    }
}

impl AmqpRouting {
    /// Publish to `exchange` with routing key = event type. The default exchange name
    /// is `outbox`.
    pub fn new(exchange: impl Into<String>) -> Self {
        Self {
            exchange: exchange.into(),
            routes: RouteTable::new(),
        }
    }

    pgoutbox_core::routing::route_builders! {
        /// Publish events of `event_type` to `exchange` with `routing_key`.
        #[must_use]
        pub fn event_type(event_type, exchange, routing_key)
            => routes.insert_event_type via Route::new;

        /// Publish events of `aggregate_type` to `exchange` with `routing_key` (unless
        /// their event type has a route).
        #[must_use]
        pub fn aggregate_type(aggregate_type, exchange, routing_key)
            => routes.insert_aggregate_type via Route::new;
    }

    /// The default exchange of this rule.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The route of `event`, validated (an error text makes the event fail permanently).
    pub fn route(&self, event: &Event) -> Result<Route, String> {
        let route = if let Some(destination) = &event.destination {
            Route::new(&self.exchange, destination)
        } else if let Some(route) = self.routes.get(event) {
            route.clone()
        } else {
            Route::new(&self.exchange, &event.event_type)
        };
        validate_exchange(&route.exchange)?;
        if route.routing_key.len() > MAX_SHORT_STRING {
            return Err(format!(
                "routing key is {} bytes long; AMQP allows {MAX_SHORT_STRING}",
                route.routing_key.len()
            ));
        }
        Ok(route)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate_exchange(&self.exchange).map_err(|r| Error::config("exchange", r))?;
        for (key, route) in self.routes.iter() {
            validate_exchange(&route.exchange)
                .map_err(|r| Error::config(format!("route `{key}`"), r))?;
            if route.routing_key.len() > MAX_SHORT_STRING {
                return Err(Error::config(
                    format!("route `{key}`"),
                    "routing key over 255 bytes",
                ));
            }
        }
        Ok(())
    }
}

/// An exchange name RabbitMQ accepts: up to 255 bytes of letters, digits, `-`, `_`,
/// `.` and `:` (empty is the default exchange).
pub fn validate_exchange(name: &str) -> Result<(), String> {
    if name.len() > MAX_SHORT_STRING {
        return Err(format!(
            "exchange name is {} bytes long; the limit is 255",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        return Err(format!("exchange name `{name}` contains `{c}`"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use pgoutbox_core::conformance::claimed_event;

    use super::*;

    #[test]
    fn rules_apply_in_order() {
        let r = AmqpRouting::new("app")
            .event_type("order.paid", "billing", "paid")
            .aggregate_type("order", "orders", "all");
        let route = |e: &Event| r.route(e).map(|r| (r.exchange, r.routing_key));
        assert_eq!(
            route(&claimed_event("order", "1", "order.paid", 1)),
            Ok(("billing".into(), "paid".into()))
        );
        assert_eq!(
            route(&claimed_event("order", "1", "order.created", 1)),
            Ok(("orders".into(), "all".into()))
        );
        assert_eq!(
            route(&claimed_event("user", "1", "user.created", 1)),
            Ok(("app".into(), "user.created".into()))
        );
        let mut e = claimed_event("order", "1", "order.paid", 1);
        e.destination = Some("special".into());
        assert_eq!(route(&e), Ok(("app".into(), "special".into())));
    }

    #[test]
    fn invalid_names_are_refused() {
        assert!(AmqpRouting::new("bad exchange").validate().is_err());
        assert!(AmqpRouting::new("ok")
            .route(&claimed_event("o", "1", &"x".repeat(300), 1))
            .is_err());
        assert!(AmqpRouting::new("").validate().is_ok());
    }
}
