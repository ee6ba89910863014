//! The Prometheus recorder: every metric of `pgoutbox_core::telemetry`, plus the
//! gauges only the binary reports.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use pgoutbox_core::{layer, telemetry};

use crate::failure::Failure;

/// Gauge: dead letters in the outbox, refreshed every `http.stats_refresh`.
pub(crate) const DEAD_LETTERS: &str = "outbox_dead_letters";
/// Gauge: age in seconds of the oldest pending event, refreshed with [`DEAD_LETTERS`].
pub(crate) const OLDEST_PENDING_AGE: &str = "outbox_oldest_pending_age_seconds";
/// Counter: rows deleted by retention cleanup.
pub(crate) const CLEANUP_DELETED: &str = "outbox_cleanup_deleted_total";
/// Gauge (WAL mode): bytes of WAL the slot's reader has not acknowledged, which
/// the server keeps for it.
pub(crate) const WAL_SLOT_LAG: &str = "outbox_wal_slot_lag_bytes";
/// Gauge: seconds the oldest transaction holding a snapshot in the cluster has
/// run (0: none): vacuum removes nothing that snapshot may see, refreshed with
/// [`DEAD_LETTERS`].
pub(crate) const OLDEST_SNAPSHOT_AGE: &str = "outbox_oldest_snapshot_age_seconds";
/// Gauge: seconds the oldest open transaction that took an event `seq` of the
/// outbox has run (0: none): claims cannot start their walk past its event.
pub(crate) const PRODUCER_TRANSACTION_AGE: &str = "outbox_producer_transaction_age_seconds";
/// Gauge (WAL mode): 1 while the slot can carry the outbox's events, 0 while it
/// cannot (missing, another database's or plugin's, temporary, invalidated):
/// then nothing is read from the WAL and producers are refused.
pub(crate) const WAL_SLOT_USABLE: &str = "outbox_wal_slot_usable";

/// Seconds to publish and record one batch: up to a publish timeout.
const BATCH_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Seconds per claim: a claim of a few hundred events takes about a millisecond;
/// the upper buckets catch plans that scan the backlog.
const CLAIM_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Seconds from commit to broker ack: includes backlogs and retries.
const LAG_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Every metric name the binary exports, for docs and tests.
#[cfg(test)]
pub(crate) const ALL: &[&str] = &[
    telemetry::EVENTS_PUBLISHED,
    telemetry::EVENTS_FAILED,
    telemetry::EVENTS_DEAD_LETTERED,
    telemetry::EVENTS_HELD_BACK,
    telemetry::EVENTS_PENDING,
    telemetry::BROKER_UP,
    telemetry::CLAIM_DURATION,
    telemetry::BATCH_DURATION,
    telemetry::PUBLISH_LAG,
    layer::PUBLISHER_EVENTS,
    layer::PUBLISHER_CALL_DURATION,
    DEAD_LETTERS,
    OLDEST_PENDING_AGE,
    CLEANUP_DELETED,
    WAL_SLOT_LAG,
    OLDEST_SNAPSHOT_AGE,
    PRODUCER_TRANSACTION_AGE,
    WAL_SLOT_USABLE,
];

/// Install the global recorder. Histograms get buckets (not summaries) so that
/// `histogram_quantile` can aggregate them across relays.
pub(crate) fn install(outboxes: &[String]) -> Result<PrometheusHandle, Failure> {
    let failed = |e: metrics_exporter_prometheus::BuildError| {
        Failure::runtime(format!("metrics exporter: {e}"))
    };
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(telemetry::CLAIM_DURATION.into()),
            CLAIM_BUCKETS,
        )
        .map_err(failed)?
        .set_buckets_for_metric(
            Matcher::Full(telemetry::BATCH_DURATION.into()),
            BATCH_BUCKETS,
        )
        .map_err(failed)?
        .set_buckets_for_metric(Matcher::Full(telemetry::PUBLISH_LAG.into()), LAG_BUCKETS)
        .map_err(failed)?
        .set_buckets_for_metric(
            Matcher::Full(layer::PUBLISHER_CALL_DURATION.into()),
            BATCH_BUCKETS,
        )
        .map_err(failed)?
        .install_recorder()
        .map_err(failed)?;
    telemetry::describe();
    metrics::describe_gauge!(DEAD_LETTERS, "Dead letters in the outbox");
    metrics::describe_gauge!(
        OLDEST_PENDING_AGE,
        metrics::Unit::Seconds,
        "Age of the oldest event waiting to be published"
    );
    metrics::describe_counter!(CLEANUP_DELETED, "Rows deleted by retention cleanup");
    metrics::describe_gauge!(
        WAL_SLOT_LAG,
        metrics::Unit::Bytes,
        "WAL mode: bytes of WAL the slot's reader has not acknowledged"
    );
    metrics::describe_gauge!(
        OLDEST_SNAPSHOT_AGE,
        metrics::Unit::Seconds,
        "Age of the oldest transaction holding a snapshot in the cluster (vacuum waits for it)"
    );
    metrics::describe_gauge!(
        PRODUCER_TRANSACTION_AGE,
        metrics::Unit::Seconds,
        "Age of the oldest open transaction that took an event seq of the outbox"
    );
    metrics::describe_gauge!(
        WAL_SLOT_USABLE,
        "WAL mode: 1 while the slot can carry the outbox's events, 0 while it cannot"
    );
    // Zero from the start, so alerts and rates see the series before the first event.
    // Labelled as the relays label them (`outbox` = each outbox's name); outboxes
    // found later (`[tenants]`) get theirs with their first event.
    for outbox in outboxes {
        metrics::counter!(telemetry::EVENTS_PUBLISHED, "outbox" => outbox.clone()).absolute(0);
        metrics::counter!(CLEANUP_DELETED, "outbox" => outbox.clone()).absolute(0);
    }
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::ALL;

    /// The `outbox_*` metrics `expr` queries, each asserted to be exported (a
    /// histogram's `_bucket`, `_sum` and `_count` series count as the histogram).
    fn assert_exported(expr: &str) -> usize {
        let names: Vec<&str> = expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|t| t.starts_with("outbox_"))
            .collect();
        assert!(!names.is_empty(), "no outbox metric in {expr}");
        for name in &names {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| ALL.contains(b)))
                .unwrap_or(name);
            assert!(ALL.contains(&base), "{name} in `{expr}` is not exported");
        }
        names.len()
    }

    /// Every alert expression in docs/alerts.yml names metrics this binary exports.
    #[test]
    fn alerts_use_exported_metrics() {
        let text = include_str!("../../docs/alerts.yml");
        let doc: serde_yaml::Value = serde_yaml::from_str(text).expect("alerts.yml is YAML");
        let groups = doc["groups"].as_sequence().expect("groups");
        let mut rules = 0;
        for group in groups {
            for rule in group["rules"].as_sequence().expect("rules") {
                rules += 1;
                assert_exported(rule["expr"].as_str().expect("expr"));
            }
        }
        assert!(rules >= 4);
    }

    /// Every query of the Grafana dashboard in docs/ (panels and variables) names
    /// metrics this binary exports.
    #[test]
    fn the_dashboard_queries_exported_metrics() {
        fn queries<'a>(value: &'a serde_json::Value, found: &mut Vec<&'a str>) {
            match value {
                serde_json::Value::Object(map) => {
                    for (key, value) in map {
                        match (key.as_str(), value.as_str()) {
                            ("expr" | "definition", Some(query)) => found.push(query),
                            _ => queries(value, found),
                        }
                    }
                }
                serde_json::Value::Array(items) => items.iter().for_each(|v| queries(v, found)),
                _ => {}
            }
        }
        let text = include_str!("../../docs/grafana-dashboard.json");
        let dashboard: serde_json::Value = serde_json::from_str(text).expect("dashboard is JSON");
        let mut found = Vec::new();
        queries(&dashboard, &mut found);
        assert!(found.len() >= 15, "{found:?}");
        let queried: usize = found.iter().map(|q| assert_exported(q)).sum();
        assert!(queried >= found.len());
        // The series an operator looks at first are all on it.
        for name in [
            pgoutbox_core::telemetry::EVENTS_PENDING,
            pgoutbox_core::telemetry::PUBLISH_LAG,
            super::DEAD_LETTERS,
            pgoutbox_core::telemetry::BROKER_UP,
        ] {
            assert!(
                found.iter().any(|q| q.contains(name)),
                "{name} is not on the dashboard"
            );
        }
    }
}
