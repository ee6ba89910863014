//! Retry policy: exponential backoff with jitter and a maximum number of attempts.

use std::time::Duration;

/// When to try a failed event again, and when to give up.
///
/// Delay before attempt `n + 1` after `n` failed attempts:
/// `min(max_delay, base_delay * 2^(n-1))`, then "equal jitter": a random value
/// between half of that and all of it, so relays that failed together do not
/// retry together.
///
/// Deserialises from a table with the keys `max_attempts`, `base_delay` and
/// `max_delay` (durations written like `500ms`, `30s`, `5m`), each optional: the
/// `[retry]` section of the `outbox` binary's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts before an event is dead-lettered. Defaults to 8.
    pub max_attempts: u32,
    /// Delay after the first failure. Defaults to 1 s.
    #[serde(deserialize_with = "crate::settings::duration")]
    pub base_delay: Duration,
    /// Upper bound of any delay. Defaults to 5 minutes.
    #[serde(deserialize_with = "crate::settings::duration")]
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// Set the attempts before dead-lettering (at least 1). Defaults to 8.
    #[must_use]
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// Set the delay after the first failure. Defaults to 1 s.
    #[must_use]
    pub fn base_delay(mut self, d: Duration) -> Self {
        self.base_delay = d;
        self
    }

    /// Set the upper bound of any delay. Defaults to 5 minutes.
    #[must_use]
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }

    /// True when an event that has now failed `attempts` times must be dead-lettered.
    pub fn exhausted(&self, attempts: u32) -> bool {
        attempts >= self.max_attempts
    }

    /// Backoff before the next try of an event that has failed `attempts` times (>= 1).
    pub fn delay(&self, attempts: u32) -> Duration {
        backoff(self.base_delay, self.max_delay, attempts)
    }
}

/// Capped exponential backoff with equal jitter after `attempts` (>= 1) failures: a
/// random value between half and all of `min(max, base * 2^(attempts-1))`.
pub fn backoff(base: Duration, max: Duration, attempts: u32) -> Duration {
    let exponent = attempts.saturating_sub(1).min(31);
    let full = base.saturating_mul(1u32 << exponent).min(max);
    let half = full / 2;
    let jitter_nanos = u64::try_from((full - half).as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(fastrand::u64(0..=jitter_nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_stay_bounded() {
        let p = RetryPolicy::default();
        for attempts in 1..40 {
            let full = (Duration::from_secs(1) * 2u32.saturating_pow(attempts - 1).min(1 << 31))
                .min(Duration::from_secs(300));
            let d = p.delay(attempts);
            assert!(
                d >= full / 2 && d <= full,
                "attempt {attempts}: {d:?} vs {full:?}"
            );
        }
    }

    #[test]
    fn exhausted_after_max_attempts() {
        let p = RetryPolicy::default().max_attempts(3);
        assert!(!p.exhausted(2));
        assert!(p.exhausted(3));
        assert_eq!(RetryPolicy::default().max_attempts(0).max_attempts, 1);
    }
}
