//! The console's history: backlog, rates and commit-to-publish lag of each
//! outbox over the last hour, sampled from the relay's own metrics into a ring
//! buffer in memory (nothing is written to the database; a restart starts it anew).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::scrape::Reading;

/// How far back the history reaches.
pub(crate) const SPAN: Duration = Duration::from_secs(3600);

/// One outbox at one sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Point {
    /// Unix time in milliseconds.
    pub(crate) at: i64,
    /// Events waiting (`None` before the relay first counted them).
    pub(crate) pending: Option<f64>,
    /// Mean seconds from commit to broker ack of the events published since the
    /// previous sample (`None`: none were).
    pub(crate) lag_seconds: Option<f64>,
    pub(crate) published_per_second: f64,
    pub(crate) failures_per_second: f64,
}

/// The ring buffers of every outbox seen, shared by the sampler and the console.
#[derive(Clone)]
pub(crate) struct History {
    capacity: usize,
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    previous: Option<(Instant, BTreeMap<String, Reading>)>,
    series: BTreeMap<String, VecDeque<Point>>,
}

impl History {
    /// A history sampled every `interval`, keeping [`SPAN`] of it.
    pub(crate) fn new(interval: Duration) -> Self {
        let per_span = SPAN.as_millis() / interval.as_millis().max(1);
        Self {
            capacity: usize::try_from(per_span)
                .unwrap_or(usize::MAX)
                .clamp(2, 36_000),
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Record the readings taken at `now` (`at`: the same instant, Unix ms): rates
    /// and lag are the changes since the previous readings.
    pub(crate) fn record(&self, now: Instant, at: i64, readings: BTreeMap<String, Reading>) {
        // A panic elsewhere while holding the lock leaves whole points behind: keep going.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let previous = state.previous.take();
        for (outbox, reading) in &readings {
            let before = previous
                .as_ref()
                .and_then(|(when, old)| Some((*when, old.get(outbox)?)));
            let point = point(at, now, reading, before);
            let series = state.series.entry(outbox.clone()).or_default();
            if series.len() == self.capacity {
                series.pop_front();
            }
            series.push_back(point);
        }
        state.previous = Some((now, readings));
    }

    /// Every outbox's points, oldest first.
    pub(crate) fn series(&self) -> BTreeMap<String, Vec<Point>> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .series
            .iter()
            .map(|(outbox, points)| (outbox.clone(), points.iter().copied().collect()))
            .collect()
    }

    /// The newest point of `outbox`.
    pub(crate) fn latest(&self, outbox: &str) -> Option<Point> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.series.get(outbox)?.back().copied()
    }
}

fn point(at: i64, now: Instant, reading: &Reading, before: Option<(Instant, &Reading)>) -> Point {
    let Some((when, old)) = before else {
        return Point {
            at,
            pending: reading.pending,
            lag_seconds: None,
            published_per_second: 0.0,
            failures_per_second: 0.0,
        };
    };
    let seconds = now.duration_since(when).as_secs_f64().max(1e-3);
    // A counter that went down was reset (the series restarted): count from zero.
    let delta = |new: f64, old: f64| if new >= old { new - old } else { new };
    let published = delta(reading.lag_count, old.lag_count);
    Point {
        at,
        pending: reading.pending,
        lag_seconds: (published > 0.0).then(|| delta(reading.lag_sum, old.lag_sum) / published),
        published_per_second: delta(reading.published, old.published) / seconds,
        failures_per_second: delta(reading.failed, old.failed) / seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(published: f64, lag_sum: f64) -> BTreeMap<String, Reading> {
        let reading = Reading {
            published,
            lag_sum,
            lag_count: published,
            pending: Some(4.0),
            ..Reading::default()
        };
        BTreeMap::from([("o".to_string(), reading)])
    }

    #[test]
    fn rates_and_lag_are_changes_between_samples_and_old_points_go() {
        let history = History::new(Duration::from_secs(1800));
        let start = Instant::now();
        history.record(start, 0, reading(10.0, 5.0));
        history.record(start + Duration::from_secs(2), 2000, reading(30.0, 25.0));
        let latest = history.latest("o").unwrap();
        assert_eq!(latest.published_per_second, 10.0);
        assert_eq!(latest.lag_seconds, Some(1.0));
        assert_eq!(latest.pending, Some(4.0));
        history.record(start + Duration::from_secs(4), 4000, reading(30.0, 25.0));
        let points = &history.series()["o"];
        // Two points per hour at this interval: the first one went.
        assert_eq!(
            points.iter().map(|p| p.at).collect::<Vec<_>>(),
            [2000, 4000]
        );
        assert_eq!(points[1].lag_seconds, None);
    }
}
