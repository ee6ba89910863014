//! Routing rules: which destination (subject, routing key, topic, queue) an event goes to.
//!
//! The same rule for every broker; each adapter validates the resulting names by its
//! own broker's rules. [`RouteTable`] holds the rules by event type and by aggregate
//! type of every adapter, whatever a destination is; [`PrefixRouting`] is the rule of
//! the brokers whose configuration sets a name prefix and a default destination apart
//! (Kafka topics, SQS queues); [`route_builders!`] writes an
//! adapter's builder methods that add a rule to a table.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::event::Event;

/// Destinations configured by event type and by aggregate type: the tables of every
/// routing rule, whatever a destination is (a name, or an AMQP exchange and routing
/// key). Sorted maps, so validation meets the rules in the same order every time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable<T> {
    by_event_type: BTreeMap<String, T>,
    by_aggregate_type: BTreeMap<String, T>,
}

// Not derived: the derive would ask for `T: Default`, which a destination need not be.
impl<T> Default for RouteTable<T> {
    fn default() -> Self {
        Self {
            by_event_type: BTreeMap::new(),
            by_aggregate_type: BTreeMap::new(),
        }
    }
}

impl<T> RouteTable<T> {
    /// No rules.
    pub fn new() -> Self {
        Self::default()
    }

    /// Send events of `event_type` to `destination`, replacing an earlier rule for it.
    pub fn insert_event_type(&mut self, event_type: impl Into<String>, destination: T) {
        self.by_event_type.insert(event_type.into(), destination);
    }

    /// Send events of `aggregate_type` to `destination` (unless their event type has a
    /// rule), replacing an earlier rule for it.
    pub fn insert_aggregate_type(&mut self, aggregate_type: impl Into<String>, destination: T) {
        self.by_aggregate_type
            .insert(aggregate_type.into(), destination);
    }

    /// The destination configured for `event`: its event type's, else its aggregate
    /// type's. The event's own destination is the caller's to look at first.
    pub fn get(&self, event: &Event) -> Option<&T> {
        self.by_event_type
            .get(&event.event_type)
            .or_else(|| self.by_aggregate_type.get(&event.aggregate_type))
    }

    /// Every rule, as the type it is for and its destination: the aggregate type
    /// rules, then the event type rules, each sorted by type.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.by_aggregate_type
            .iter()
            .chain(&self.by_event_type)
            .map(|(key, destination)| (key.as_str(), destination))
    }

    /// Every configured destination, in the order of [`RouteTable::iter`].
    pub fn destinations(&self) -> impl Iterator<Item = &T> {
        self.iter().map(|(_, destination)| destination)
    }
}

/// Writes an adapter's builder methods that add a rule to a [`RouteTable`] field,
/// inside its `impl` block, so every adapter adds rules the same way. Each line gives
/// the method's attributes (docs, `#[must_use]`), visibility and name, its parameters
/// (the type, then the destination) and, after `=>`, the path from `self` to the
/// table's insert method it calls. A destination of one name is a `String`; one of
/// several parts (an AMQP exchange and routing key) is built by the constructor named
/// after `via`, which takes the parts. Every parameter is an `impl Into<String>`; the
/// method takes and returns `self`.
///
/// ```
/// use pgoutbox_core::routing::RouteTable;
///
/// #[derive(Debug, PartialEq)]
/// pub struct Route(String, String);
///
/// impl Route {
///     fn new(exchange: impl Into<String>, key: impl Into<String>) -> Self {
///         Self(exchange.into(), key.into())
///     }
/// }
///
/// #[derive(Default)]
/// pub struct Config {
///     routes: RouteTable<String>,
///     exchanges: RouteTable<Route>,
/// }
///
/// impl Config {
///     pgoutbox_core::routing::route_builders! {
///         /// Send events of this event type to `topic`.
///         pub fn route_event_type(event_type, topic) => routes.insert_event_type;
///         /// Send events of this aggregate type to `topic`.
///         pub fn route_aggregate_type(aggregate_type, topic) => routes.insert_aggregate_type;
///         /// Send events of this event type to `exchange` with `key`.
///         pub fn exchange(event_type, exchange, key)
///             => exchanges.insert_event_type via Route::new;
///     }
/// }
///
/// let config = Config::default()
///     .route_event_type("order.paid", "payments")
///     .exchange("order.paid", "billing", "paid");
/// assert_eq!(config.routes.iter().collect::<Vec<_>>(), [("order.paid", &"payments".to_string())]);
/// let route = Route::new("billing", "paid");
/// assert_eq!(config.exchanges.iter().next(), Some(("order.paid", &route)));
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __route_builders {
    // One part is the destination itself; several make one with the `via` constructor.
    (@destination ; $destination:ident) => { $destination.into() };
    (@destination $make:path; $($part:ident),+) => { $make($($part),+) };
    ($(
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($key:ident, $($part:ident),+)
            => $($insert:ident).+ $(via $make:path)?;
    )*) => {$(
        $(#[$attr])*
        $vis fn $name(mut self, $key: impl Into<String>, $($part: impl Into<String>),+) -> Self {
            self.$($insert).+($key, $crate::routing::route_builders!(@destination $($make)?; $($part),+));
            self
        }
    )*};
}

#[doc(inline)]
pub use crate::__route_builders as route_builders;

/// Chooses a destination for each event. The first that applies wins:
/// 1. the event's own `destination` (set at enqueue);
/// 2. a destination configured for its event type;
/// 3. a destination configured for its aggregate type;
/// 4. the default template, where `{event_type}` and `{aggregate_type}` are replaced
///    by the event's values (e.g. `outbox.{event_type}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    template: String,
    rules: RouteTable<String>,
}

impl Routing {
    /// Route by `template` unless a rule below applies.
    pub fn new(template: impl Into<String>) -> Self {
        Self::with_rules(template, RouteTable::new())
    }

    /// Route by `rules`, and by `template` where none applies.
    pub fn with_rules(template: impl Into<String>, rules: RouteTable<String>) -> Self {
        Self {
            template: template.into(),
            rules,
        }
    }

    route_builders! {
        /// Send events of `event_type` to `destination`.
        #[must_use]
        pub fn event_type(event_type, destination) => rules.insert_event_type;

        /// Send events of `aggregate_type` to `destination` (unless their event type has a rule).
        #[must_use]
        pub fn aggregate_type(aggregate_type, destination) => rules.insert_aggregate_type;
    }

    /// The default template.
    pub fn template(&self) -> &str {
        &self.template
    }

    /// Every configured destination, for validation at build time.
    pub fn configured(&self) -> impl Iterator<Item = &str> {
        self.rules.destinations().map(String::as_str)
    }

    /// Where `event` goes.
    pub fn destination<'e>(&'e self, event: &'e Event) -> Cow<'e, str> {
        if let Some(d) = &event.destination {
            return Cow::Borrowed(d);
        }
        if let Some(d) = self.rules.get(event) {
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

/// The rule of brokers whose configuration sets a name prefix and a default
/// destination apart (Kafka topics, SQS queues), most specific first: the event's
/// destination, a rule for its event type, a rule for its aggregate type, the default
/// destination, and `<prefix><aggregate_type>`. Collected by an adapter's config
/// builder, then [compiled](PrefixRouting::compile) into a [`Routing`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixRouting {
    /// Prefix of `<prefix><aggregate_type>`, the default without a default
    /// destination. Empty by default.
    pub prefix: String,
    /// The destination of every event without a more specific rule. None by default.
    pub default: Option<String>,
    /// The rules by event type and by aggregate type.
    pub rules: RouteTable<String>,
}

impl PrefixRouting {
    /// Every destination named: the default, then the rules' ([`RouteTable::iter`]'s
    /// order). Those of the prefix are not known in advance.
    pub fn named(&self) -> impl Iterator<Item = &str> {
        self.default
            .iter()
            .chain(self.rules.destinations())
            .map(String::as_str)
    }

    /// The rule as a [`Routing`]; the default destination is its template as it is.
    pub fn compile(&self) -> Routing {
        let template = match &self.default {
            Some(default) => default.clone(),
            None => format!("{}{{aggregate_type}}", self.prefix),
        };
        Routing::with_rules(template, self.rules.clone())
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

    #[test]
    fn prefix_routing_compiles_to_the_same_order() {
        let mut rules = PrefixRouting {
            prefix: "ev.".into(),
            ..PrefixRouting::default()
        };
        rules
            .rules
            .insert_event_type("order.paid", "payments".to_string());
        rules
            .rules
            .insert_aggregate_type("order", "orders".to_string());
        let r = rules.compile();
        assert_eq!(r.destination(&event("order", "order.paid")), "payments");
        assert_eq!(r.destination(&event("order", "order.created")), "orders");
        assert_eq!(r.destination(&event("user", "user.created")), "ev.user");
        assert_eq!(rules.named().collect::<Vec<_>>(), ["orders", "payments"]);
        rules.default = Some("all".into());
        assert_eq!(rules.compile().destination(&event("user", "x")), "all");
        assert_eq!(rules.named().next(), Some("all"));
    }
}
