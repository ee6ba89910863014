//! The relay's own metrics read back from the exporter's text: the console's
//! rates and history come from the counters the relay keeps anyway, so watching
//! it adds no query to the database and no bookkeeping to the claim path.

use std::collections::BTreeMap;

use pgoutbox_core::telemetry;

use crate::exporter;

/// One outbox's series at one instant (counters are totals since the start).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Reading {
    pub(crate) published: f64,
    pub(crate) failed: f64,
    pub(crate) dead_lettered: f64,
    /// `outbox_events_pending`, refreshed by the relay every `relay.pending_refresh`.
    pub(crate) pending: Option<f64>,
    /// The publish-lag histogram's sum and count.
    pub(crate) lag_sum: f64,
    pub(crate) lag_count: f64,
    pub(crate) broker_up: Option<f64>,
    pub(crate) wal_slot_lag_bytes: Option<f64>,
}

/// Each outbox's reading in a Prometheus text exposition, by the `outbox` label.
/// Series of one outbox with other labels (`event_type`) are summed.
pub(crate) fn read(text: &str) -> BTreeMap<String, Reading> {
    let mut readings: BTreeMap<String, Reading> = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, labels)) => (name, labels.strip_suffix('}').unwrap_or(labels)),
            None => (series, ""),
        };
        let Some(outbox) = label(labels, "outbox") else {
            continue;
        };
        let reading = readings.entry(outbox).or_default();
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match name {
            telemetry::EVENTS_PUBLISHED => reading.published += value,
            telemetry::EVENTS_FAILED => reading.failed += value,
            telemetry::EVENTS_DEAD_LETTERED => reading.dead_lettered += value,
            telemetry::EVENTS_PENDING => add(&mut reading.pending),
            telemetry::BROKER_UP => reading.broker_up = Some(value),
            exporter::WAL_SLOT_LAG => reading.wal_slot_lag_bytes = Some(value),
            _ if name.strip_suffix("_sum") == Some(telemetry::PUBLISH_LAG) => {
                reading.lag_sum += value;
            }
            _ if name.strip_suffix("_count") == Some(telemetry::PUBLISH_LAG) => {
                reading.lag_count += value;
            }
            _ => {}
        }
    }
    readings
}

/// The value of label `key` in `a="x",b="y"`, unescaped (`\"`, `\\`, `\n`).
fn label(labels: &str, key: &str) -> Option<String> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        if name.trim_start_matches(',').trim() == key {
            return Some(value);
        }
        rest = after[end + 1..].trim_start_matches(',');
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_summed_by_outbox() {
        let text = "# TYPE outbox_events_published_total counter\n\
            outbox_events_published_total{outbox=\"public.outbox_events\"} 12\n\
            outbox_events_failed_total{outbox=\"public.outbox_events\",event_type=\"a\"} 2\n\
            outbox_events_failed_total{event_type=\"b\",outbox=\"public.outbox_events\"} 3\n\
            outbox_events_pending{outbox=\"t\\\"x\"} 7\n\
            outbox_publish_lag_seconds_sum{outbox=\"public.outbox_events\"} 1.5\n\
            outbox_publish_lag_seconds_count{outbox=\"public.outbox_events\"} 3\n\
            outbox_publish_lag_seconds_bucket{outbox=\"public.outbox_events\",le=\"+Inf\"} 3\n\
            outbox_broker_up{outbox=\"public.outbox_events\"} 1\n\
            process_start_time_seconds 5\n";
        let readings = read(text);
        let main = readings["public.outbox_events"];
        assert_eq!(main.published, 12.0);
        assert_eq!(main.failed, 5.0);
        assert_eq!((main.lag_sum, main.lag_count), (1.5, 3.0));
        assert_eq!(main.broker_up, Some(1.0));
        assert_eq!(main.pending, None);
        assert_eq!(readings["t\"x"].pending, Some(7.0));
        assert_eq!(readings.len(), 2);
    }
}
