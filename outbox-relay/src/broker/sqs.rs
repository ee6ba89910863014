//! `broker.kind = "sqs"`: Amazon SQS, `[broker.sqs]` is [`SqsSettings`].

use std::sync::Arc;

use pgoutbox_core::settings::EnvOverrides;
use pgoutbox_core::DynPublisher;
use pgoutbox_sqs::{SqsConfig, SqsSettings};

use super::{BoxError, BrokerError, BrokerFactory, BrokerInput, BuildFuture};

/// The SQS broker's factory.
pub(super) struct Sqs;

impl Sqs {
    fn config(input: &BrokerInput) -> Result<SqsConfig, BoxError> {
        let settings = input.parse::<SqsSettings>()?.with_env()?;
        let mut config = SqsConfig::from_settings(&settings)?.envelope(input.envelope().clone());
        for (event_type, queue) in input.routes_by_event_type() {
            config = config.route_event_type(event_type, queue);
        }
        for (aggregate_type, queue) in input.routes_by_aggregate_type() {
            config = config.route_aggregate_type(aggregate_type, queue);
        }
        Ok(config)
    }
}

impl BrokerFactory for Sqs {
    fn check(&self, input: &BrokerInput) -> Result<(), BoxError> {
        Self::config(input).map(drop)
    }

    fn build(&self, input: BrokerInput) -> BuildFuture {
        Box::pin(async move {
            let config = Self::config(&input).map_err(BrokerError::Invalid)?;
            let publisher = config
                .build()
                .await
                .map_err(|e| BrokerError::Invalid(e.into()))?;
            let publisher: Arc<dyn DynPublisher> = Arc::new(publisher);
            Ok(publisher)
        })
    }
}
