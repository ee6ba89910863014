//! `broker.kind = "nats"`: NATS JetStream, `[broker.nats]` is [`NatsSettings`].

use std::sync::Arc;

use pgoutbox_core::settings::EnvOverrides;
use pgoutbox_core::DynPublisher;
use pgoutbox_nats::{NatsConfig, NatsSettings, SubjectRouting};

use super::{BoxError, BrokerError, BrokerFactory, BrokerInput, BuildFuture};

/// The NATS JetStream broker's factory.
pub(super) struct Nats;

impl Nats {
    /// The adapter's config, and the stream to create when missing.
    fn config(input: &BrokerInput) -> Result<(NatsConfig, Option<String>), BoxError> {
        let settings = input.parse::<NatsSettings>()?.with_env()?;
        let config = NatsConfig::from_settings(&settings)?;
        let mut rules = SubjectRouting::new(config.routing.prefix());
        for (event_type, subject) in input.routes_by_event_type() {
            rules = rules.event_type(event_type, subject);
        }
        for (aggregate_type, subject) in input.routes_by_aggregate_type() {
            rules = rules.aggregate_type(aggregate_type, subject);
        }
        let config = config.routing(rules).envelope(input.envelope().clone());
        config.validate()?;
        Ok((config, settings.ensure_stream))
    }
}

impl BrokerFactory for Nats {
    fn check(&self, input: &BrokerInput) -> Result<(), BoxError> {
        Self::config(input).map(drop)
    }

    fn build(&self, input: BrokerInput) -> BuildFuture {
        Box::pin(async move {
            let (config, stream) = Self::config(&input).map_err(BrokerError::Invalid)?;
            let publisher = config
                .build()
                .await
                .map_err(|e| BrokerError::Invalid(e.into()))?;
            if let (true, Some(name)) = (input.creates_missing(), stream) {
                let stream_config = publisher.stream_config(&name);
                publisher
                    .ensure_stream(stream_config)
                    .await
                    .map_err(|e| BrokerError::Unavailable(e.into()))?;
            }
            let publisher: Arc<dyn DynPublisher> = Arc::new(publisher);
            Ok(publisher)
        })
    }
}
