//! The statistics every scenario and the report share: one percentile rule, one
//! latency definition, and the verdict of a target over rounds.

use std::time::Instant;

/// The `q` quantile (0 < q <= 1) of sorted values by the nearest-rank rule: the
/// smallest value with at least `q` of all values at or below it. NaN when there
/// are none, so that an empty sample cannot pass for a fast one.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (sorted.len() as f64 * q).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Sorted samples (latencies in milliseconds, usually) and their percentiles.
#[derive(Debug, Clone, Default)]
pub(crate) struct Percentiles(Vec<f64>);

impl Percentiles {
    pub(crate) fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut values: Vec<f64> = values.into_iter().collect();
        values.sort_by(f64::total_cmp);
        Self(values)
    }

    /// The `q` quantile, as [`percentile`].
    pub(crate) fn at(&self, q: f64) -> f64 {
        percentile(&self.0, q)
    }

    /// The largest sample (NaN when there are none).
    pub(crate) fn max(&self) -> f64 {
        self.0.last().copied().unwrap_or(f64::NAN)
    }
}

/// Commit-to-publish latency in milliseconds, the one definition of every scenario:
/// from the producer's clock taken inside its transaction just before `COMMIT` is
/// sent (or, for a single autocommitted `INSERT`, just before the statement) to the
/// instant the event reached the publisher or consumer, on the same clock. Signed:
/// an arrival before the stamp would show as a negative value instead of being
/// hidden as 0 (it cannot happen when the stamp precedes the commit).
pub(crate) fn latency_millis(stamped: Instant, arrived: Instant) -> f64 {
    if arrived >= stamped {
        arrived.duration_since(stamped).as_secs_f64() * 1000.0
    } else {
        -(stamped.duration_since(arrived).as_secs_f64() * 1000.0)
    }
}

/// The median of `values` (the mean of the middle two for an even count); NaN
/// when there are none.
pub(crate) fn median(values: &[f64]) -> f64 {
    let sorted = Percentiles::of(values.iter().copied()).0;
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Smallest, median and largest of some values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Spread {
    pub(crate) min: f64,
    pub(crate) median: f64,
    pub(crate) max: f64,
}

impl Spread {
    /// NaN everywhere when there are no values.
    pub(crate) fn of(values: &[f64]) -> Self {
        let min = values.iter().copied().fold(f64::NAN, f64::min);
        let max = values.iter().copied().fold(f64::NAN, f64::max);
        Self {
            min,
            median: median(values),
            max,
        }
    }

    /// `max - min`.
    pub(crate) fn width(&self) -> f64 {
        self.max - self.min
    }
}

/// The ratio of each round: `a[i] / b[i]`. Rounds pair the two arms measured
/// back to back, so a ratio per round cancels the drift of the machine between
/// rounds, which a ratio of two best-ofs does not.
pub(crate) fn ratios_per_round(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a / b).collect()
}

/// What a figure must reach.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) enum Target {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    pub(crate) fn holds(self, value: f64) -> bool {
        match self {
            Target::AtLeast(t) => value >= t,
            Target::AtMost(t) => value <= t,
        }
    }

    fn threshold(self) -> f64 {
        match self {
            Target::AtLeast(t) | Target::AtMost(t) => t,
        }
    }

    pub(crate) fn describe(self) -> String {
        match self {
            Target::AtLeast(t) => format!(">= {}", trim(t)),
            Target::AtMost(t) => format!("<= {}", trim(t)),
        }
    }
}

fn trim(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A target's verdict over the values of its rounds (or of repeated runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Met,
    NotMet,
    /// The values spread wider than the median's distance to the target: another
    /// run could land on the other side.
    Inconclusive,
}

impl Verdict {
    /// The median decides, unless the values' spread (max - min) is larger than
    /// the median's margin to the target.
    pub(crate) fn of(values: &[f64], target: Target) -> Self {
        let spread = Spread::of(values);
        if spread.median.is_nan() {
            return Verdict::Inconclusive;
        }
        let margin = (spread.median - target.threshold()).abs();
        if spread.width() > margin {
            Verdict::Inconclusive
        } else if target.holds(spread.median) {
            Verdict::Met
        } else {
            Verdict::NotMet
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::NotMet => "NOT met",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), 50.0);
        assert_eq!(percentile(&values, 0.99), 99.0);
        assert_eq!(percentile(&values, 1.0), 100.0);
        assert_eq!(percentile(&values, 0.001), 1.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        // Ten values: p99 is the largest, p90 the ninth.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 0.99), 10.0);
        assert_eq!(percentile(&ten, 0.9), 9.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn percentiles_sort_their_samples() {
        let p = Percentiles::of([5.0, 1.0, 4.0, 2.0, 3.0]);
        assert_eq!(p.at(0.5), 3.0);
        assert_eq!(p.max(), 5.0);
        assert!(Percentiles::of([]).max().is_nan());
    }

    #[test]
    fn latency_is_signed_not_clamped() {
        let stamped = Instant::now();
        let later = stamped + Duration::from_millis(3);
        assert!((latency_millis(stamped, later) - 3.0).abs() < 1e-9);
        assert!((latency_millis(later, stamped) + 3.0).abs() < 1e-9);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn ratio_per_round_pairs_rounds() {
        assert_eq!(
            ratios_per_round(&[10.0, 9.0, 12.0], &[10.0, 12.0, 8.0]),
            vec![1.0, 0.75, 1.5]
        );
        let spread = Spread::of(&ratios_per_round(&[10.0, 9.0, 12.0], &[10.0, 12.0, 8.0]));
        assert_eq!(
            spread,
            Spread {
                min: 0.75,
                median: 1.0,
                max: 1.5
            }
        );
        assert_eq!(spread.width(), 0.75);
    }

    #[test]
    fn verdict_needs_the_spread_inside_the_margin() {
        // Median 1.0, spread 0.1, margin 0.2 to ">= 0.8": met.
        assert_eq!(
            Verdict::of(&[0.95, 1.0, 1.05], Target::AtLeast(0.8)),
            Verdict::Met
        );
        // Median 0.7, spread 0.05, margin 0.1: not met.
        assert_eq!(
            Verdict::of(&[0.68, 0.7, 0.73], Target::AtLeast(0.8)),
            Verdict::NotMet
        );
        // Median 0.85 meets 0.8, but the rounds spread 0.3 > margin 0.05.
        assert_eq!(
            Verdict::of(&[0.7, 0.85, 1.0], Target::AtLeast(0.8)),
            Verdict::Inconclusive
        );
        // Upper bounds: p99 of 3 ms against <= 5 ms.
        assert_eq!(
            Verdict::of(&[2.9, 3.0, 3.2], Target::AtMost(5.0)),
            Verdict::Met
        );
        assert_eq!(
            Verdict::of(&[6.0, 6.5, 7.0], Target::AtMost(5.0)),
            Verdict::NotMet
        );
        assert_eq!(Verdict::of(&[], Target::AtMost(5.0)), Verdict::Inconclusive);
    }

    #[test]
    fn targets_describe_themselves() {
        assert_eq!(Target::AtLeast(0.8).describe(), ">= 0.8");
        assert_eq!(Target::AtMost(5.0).describe(), "<= 5");
        assert_eq!(Target::AtLeast(0.5).describe(), ">= 0.5");
    }
}
