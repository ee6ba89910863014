//! `broker.kind = "amqp"`: RabbitMQ (AMQP 0.9.1), `[broker.amqp]` is [`AmqpSettings`].

use std::sync::Arc;

use pgoutbox_amqp::{AmqpConfig, AmqpRouting, AmqpSettings};
use pgoutbox_core::settings::EnvOverrides;
use pgoutbox_core::DynPublisher;

use super::{BoxError, BrokerError, BrokerFactory, BrokerInput, BuildFuture};

/// The RabbitMQ broker's factory.
pub(super) struct Amqp;

impl Amqp {
    fn config(input: &BrokerInput) -> Result<AmqpConfig, BoxError> {
        let settings = input.parse::<AmqpSettings>()?.with_env()?;
        let config = AmqpConfig::from_settings(&settings)?;
        let exchange = config.routing.exchange().to_string();
        let mut rules = AmqpRouting::new(exchange.clone());
        // A destination is `exchange/routing_key`, or a routing key on the default exchange.
        let split = |dest: &str| match dest.split_once('/') {
            Some((ex, key)) => (ex.to_string(), key.to_string()),
            None => (exchange.clone(), dest.to_string()),
        };
        for (event_type, dest) in input.routes_by_event_type() {
            let (ex, key) = split(dest);
            rules = rules.event_type(event_type, ex, key);
        }
        for (aggregate_type, dest) in input.routes_by_aggregate_type() {
            let (ex, key) = split(dest);
            rules = rules.aggregate_type(aggregate_type, ex, key);
        }
        let config = config.routing(rules).envelope(input.envelope().clone());
        config.validate()?;
        Ok(config)
    }
}

impl BrokerFactory for Amqp {
    fn check(&self, input: &BrokerInput) -> Result<(), BoxError> {
        Self::config(input).map(drop)
    }

    fn build(&self, input: BrokerInput) -> BuildFuture {
        Box::pin(async move {
            let config = Self::config(&input).map_err(BrokerError::Invalid)?;
            let publisher = config.build().map_err(|e| BrokerError::Invalid(e.into()))?;
            let publisher: Arc<dyn DynPublisher> = Arc::new(publisher);
            Ok(publisher)
        })
    }
}
