//! `broker.kind = "stdout"`: one JSON line per event on standard output, no broker.

use std::sync::Arc;

use pgoutbox_core::{DynPublisher, StdoutPublisher};

use super::{BrokerFactory, BrokerInput, BuildFuture};

/// The stdout broker's factory: it has no settings.
pub(super) struct Stdout;

impl BrokerFactory for Stdout {
    fn build(&self, _input: BrokerInput) -> BuildFuture {
        Box::pin(async {
            let publisher: Arc<dyn DynPublisher> = Arc::new(StdoutPublisher);
            Ok(publisher)
        })
    }
}
