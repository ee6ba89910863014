//! Publishing a claim in per-aggregate order: waves and the hold-back rule.
//!
//! A claim may hold a *run* of several events of one aggregate. The relay publishes
//! it in waves: wave `k` holds the `k`-th event of every run whose earlier events
//! were all published, so the events of one aggregate go out one after the other
//! (each only after the broker acknowledged the previous one) while different
//! aggregates go out together. Once an event of a run is not published, the rest of
//! its run is held back: never sent, left pending without an attempt, so nothing
//! overtakes it. Every publisher gets this rule from the relay; none implements it.
//!
//! A publisher that pipelines runs ([`crate::RunOrder::Pipelined`]) gets each run
//! of several events in one call instead ([`crate::Publisher::publish_run`]), and
//! keeps the order itself; the single events of the claim still go out in one call.

use std::collections::HashMap;

use rapidhash::fast::GlobalState;

use crate::event::Event;

/// The claim's events in wave order, and where each came from.
#[derive(Debug)]
pub(crate) struct Waves {
    /// Index into the claim of each event, wave after wave; within a wave, in
    /// claim order.
    order: Vec<usize>,
    /// `order[starts[k]..starts[k + 1]]` is wave `k`.
    starts: Vec<usize>,
    /// Run (aggregate) number of each event of the claim.
    run_of: Vec<usize>,
    runs: usize,
}

impl Waves {
    /// Group `events` (claim order) into runs by aggregate and runs into waves.
    pub(crate) fn of(events: &[Event]) -> Self {
        // Not the standard SipHash: hashing the keys was most of this function's
        // time (~900 instructions per event on a claim of 200 distinct aggregates).
        // The keys come from the outbox table; the map never holds more than one
        // claim's aggregates, and the seed is random per process.
        let mut run_index: HashMap<(&str, &str), usize, GlobalState> =
            HashMap::with_capacity_and_hasher(events.len(), GlobalState::default());
        let mut depth_of = Vec::with_capacity(events.len());
        let mut run_of = Vec::with_capacity(events.len());
        let mut run_len: Vec<usize> = Vec::new();
        for event in events {
            let key = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
            let next = run_index.len();
            let run = *run_index.entry(key).or_insert(next);
            if run == run_len.len() {
                run_len.push(0);
            }
            depth_of.push(run_len[run]);
            run_len[run] += 1;
            run_of.push(run);
        }
        let depth = run_len.iter().copied().max().unwrap_or(0);
        let mut order: Vec<usize> = (0..events.len()).collect();
        // Stable: claim order within a wave.
        order.sort_by_key(|&i| depth_of[i]);
        let mut starts = Vec::with_capacity(depth + 1);
        let mut wave = usize::MAX;
        for (position, &i) in order.iter().enumerate() {
            if depth_of[i] != wave {
                wave = depth_of[i];
                starts.push(position);
            }
        }
        starts.push(order.len());
        Self {
            order,
            starts,
            run_of,
            runs: run_len.len(),
        }
    }

    /// Number of waves: the longest run.
    pub(crate) fn len(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Number of runs: the distinct aggregates of the claim.
    pub(crate) fn runs(&self) -> usize {
        self.runs
    }

    /// Claim indices of wave `k`.
    pub(crate) fn wave(&self, k: usize) -> &[usize] {
        &self.order[self.starts[k]..self.starts[k + 1]]
    }

    /// The run of the claim's event `i`.
    pub(crate) fn run_of(&self, i: usize) -> usize {
        self.run_of[i]
    }

    /// The claim indices of each run, in claim order: for a publisher that sends a
    /// run in one call ([`crate::RunOrder::Pipelined`]).
    pub(crate) fn runs_members(&self) -> Vec<Vec<usize>> {
        let mut runs = vec![Vec::new(); self.runs];
        for (i, &run) in self.run_of.iter().enumerate() {
            runs[run].push(i);
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(aggregates: &[&str]) -> Vec<Event> {
        aggregates
            .iter()
            .enumerate()
            .map(|(n, a)| Event {
                id: uuid::Uuid::now_v7(),
                seq: n as i64,
                aggregate_type: "order".into(),
                aggregate_id: (*a).into(),
                event_type: "order.created".into(),
                payload: serde_json::value::RawValue::from_string("{}".into())
                    .unwrap_or_else(|_| unreachable!("valid JSON")),
                headers: crate::Headers::new(),
                destination: None,
                created_at: chrono::Utc::now(),
                attempts: 0,
            })
            .collect()
    }

    #[test]
    fn one_event_per_aggregate_is_one_wave() {
        let waves = Waves::of(&events(&["a", "b", "c"]));
        assert_eq!(waves.len(), 1);
        assert_eq!(waves.wave(0), &[0, 1, 2]);
        assert_eq!(waves.runs(), 3);
    }

    #[test]
    fn runs_are_spread_over_waves_in_order() {
        // a a b a c b
        let waves = Waves::of(&events(&["a", "a", "b", "a", "c", "b"]));
        assert_eq!(waves.len(), 3);
        assert_eq!(waves.wave(0), &[0, 2, 4]);
        assert_eq!(waves.wave(1), &[1, 5]);
        assert_eq!(waves.wave(2), &[3]);
        assert_eq!(waves.run_of(3), waves.run_of(0));
        assert_ne!(waves.run_of(2), waves.run_of(0));
    }

    #[test]
    fn runs_members_keep_claim_order() {
        let waves = Waves::of(&events(&["a", "a", "b", "a", "c", "b"]));
        assert_eq!(
            waves.runs_members(),
            vec![vec![0, 1, 3], vec![2, 5], vec![4]]
        );
    }

    #[test]
    fn empty_claim_has_no_wave() {
        let waves = Waves::of(&[]);
        assert_eq!(waves.len(), 0);
    }
}
