//! Retrying and purging dead letters: the one path of the `dead-letters` commands
//! and of the console, so that both change the same rows and write the same audit
//! line.

use pgoutbox_core::{DeadLetterAdmin, DeadLetterFilter, StoreError};

/// The log target of the audit lines: `OUTBOX_LOG=outbox::audit=info` keeps them
/// whatever else is filtered.
pub(crate) const AUDIT: &str = "outbox::audit";

/// What is done to the matching dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Publishable again (attempts reset, due now).
    Retry,
    /// Deleted for good.
    Purge,
}

impl Change {
    /// The verb, as commands and the audit line say it.
    pub(crate) fn verb(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Purge => "purge",
        }
    }
}

/// Apply `change` to the dead letters of `outbox` that `filter` selects, and write
/// the audit line: who (`by`: `cli`, or `console` with the client's address),
/// what, which selection, how many rows. Returns how many.
pub(crate) async fn apply(
    admin: &impl DeadLetterAdmin,
    outbox: &str,
    change: Change,
    filter: &DeadLetterFilter,
    by: &str,
) -> Result<u64, StoreError> {
    let result = match change {
        Change::Retry => admin.retry(filter).await,
        Change::Purge => admin.purge(filter).await,
    };
    match &result {
        Ok(affected) => tracing::info!(
            target: AUDIT,
            action = change.verb(),
            %outbox,
            selection = %describe(filter),
            affected,
            by,
            "dead letters changed"
        ),
        Err(error) => tracing::warn!(
            target: AUDIT,
            action = change.verb(),
            %outbox,
            selection = %describe(filter),
            %error,
            by,
            "dead letters not changed"
        ),
    }
    result
}

/// `filter` in one line, as the options that select the same dead letters.
pub(crate) fn describe(filter: &DeadLetterFilter) -> String {
    let mut parts = Vec::new();
    let mut text = |key: &str, value: &Option<String>| {
        if let Some(value) = value {
            parts.push(format!("{key}={value:?}"));
        }
    };
    text("event_type", &filter.event_type);
    text("aggregate_type", &filter.aggregate_type);
    text("aggregate_id", &filter.aggregate_id);
    text("error", &filter.error_contains);
    if let Some(age) = filter.older_than {
        parts.push(format!("older_than={}", humantime::format_duration(age)));
    }
    if let Some(ids) = &filter.ids {
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        parts.push(format!("ids={}", ids.join(",")));
    }
    if parts.is_empty() {
        "all".to_string()
    } else {
        parts.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_selection_reads_as_the_options_that_make_it() {
        assert_eq!(describe(&DeadLetterFilter::default()), "all");
        let filter = DeadLetterFilter::default()
            .event_type("order.paid")
            .error_contains("timed out")
            .older_than(Duration::from_secs(600));
        assert_eq!(
            describe(&filter),
            "event_type=\"order.paid\" error=\"timed out\" older_than=10m"
        );
    }
}
