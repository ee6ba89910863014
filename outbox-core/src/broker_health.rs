//! Whether the broker as a whole takes messages, as the relay last saw it.
//!
//! A broker outage is not a failure of the events in flight: it counts no attempt
//! against them. Instead the relay marks the broker down, stops claiming, and probes
//! it ([`crate::Publisher::check`]) until it answers; then claims resume, and the
//! first message the broker takes ends the outage.

use std::time::{Duration, Instant};

use tokio::sync::watch;

/// The broker's state as the relay last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerStatus {
    /// Taking messages (also the state before the first batch).
    Up,
    /// Failed as a whole since `since`: claims are paused and the broker is probed.
    Down {
        /// When the outage began.
        since: Instant,
        /// The failure that began it.
        reason: String,
    },
    /// The probe passed after an outage that began at `since`: claims resumed, but
    /// no message has gone through yet. Another broker-wide failure returns to
    /// `Down` and continues the same outage.
    Recovering {
        /// When the outage began.
        since: Instant,
        /// The failure that began it.
        reason: String,
    },
}

/// The broker state shared by a relay's claim loops, its probe loop and readiness
/// checks ([`crate::Relay::broker_health`]).
#[derive(Debug)]
pub struct BrokerHealth {
    status: watch::Sender<BrokerStatus>,
}

impl Default for BrokerHealth {
    fn default() -> Self {
        Self {
            status: watch::Sender::new(BrokerStatus::Up),
        }
    }
}

/// What a reported failure or success changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing that needs telling.
    None,
    /// The broker was up and is down now.
    WentDown,
    /// The broker took a message after an outage that lasted this long.
    CameBack(Duration),
}

impl BrokerHealth {
    /// The current state.
    pub fn status(&self) -> BrokerStatus {
        self.status.borrow().clone()
    }

    /// True unless an outage is going on (`Down` or `Recovering`).
    pub fn is_up(&self) -> bool {
        matches!(*self.status.borrow(), BrokerStatus::Up)
    }

    /// An outage is going on and the probe has not passed yet: no claiming.
    pub(crate) fn is_down(&self) -> bool {
        matches!(*self.status.borrow(), BrokerStatus::Down { .. })
    }

    /// A publish failed because of the broker as a whole.
    pub(crate) fn failed(&self, reason: &str, now: Instant) -> Change {
        let mut change = Change::None;
        self.status.send_if_modified(|status| match status {
            BrokerStatus::Up => {
                *status = BrokerStatus::Down {
                    since: now,
                    reason: reason.to_string(),
                };
                change = Change::WentDown;
                true
            }
            BrokerStatus::Recovering { since, reason } => {
                *status = BrokerStatus::Down {
                    since: *since,
                    reason: std::mem::take(reason),
                };
                true
            }
            BrokerStatus::Down { .. } => false,
        });
        change
    }

    /// The probe passed: claims may resume.
    pub(crate) fn answered(&self) {
        self.status.send_if_modified(|status| match status {
            BrokerStatus::Down { since, reason } => {
                *status = BrokerStatus::Recovering {
                    since: *since,
                    reason: std::mem::take(reason),
                };
                true
            }
            BrokerStatus::Up | BrokerStatus::Recovering { .. } => false,
        });
    }

    /// The broker took a message.
    pub(crate) fn took_message(&self, now: Instant) -> Change {
        let mut change = Change::None;
        self.status.send_if_modified(|status| match status {
            BrokerStatus::Up => false,
            BrokerStatus::Down { since, .. } | BrokerStatus::Recovering { since, .. } => {
                change = Change::CameBack(now.saturating_duration_since(*since));
                *status = BrokerStatus::Up;
                true
            }
        });
        change
    }

    /// A claim cycle after the probe passed met no broker-wide failure (it found
    /// nothing to publish, or only messages that failed alone): the outage is over.
    pub(crate) fn settled(&self, now: Instant) -> Change {
        let mut change = Change::None;
        self.status.send_if_modified(|status| match status {
            BrokerStatus::Recovering { since, .. } => {
                change = Change::CameBack(now.saturating_duration_since(*since));
                *status = BrokerStatus::Up;
                true
            }
            BrokerStatus::Up | BrokerStatus::Down { .. } => false,
        });
        change
    }

    /// Wait until claims may go on (the broker is not `Down`), at most `limit`.
    pub(crate) async fn wait_claimable(&self, limit: Duration) {
        let mut receiver = self.status.subscribe();
        let claimable = receiver.wait_for(|s| !matches!(s, BrokerStatus::Down { .. }));
        let _ = tokio::time::timeout(limit, claimable).await;
    }

    /// Wait until the broker is `Down`; returns when its outage began.
    pub(crate) async fn wait_down(&self) -> Instant {
        let mut receiver = self.status.subscribe();
        let since = match receiver
            .wait_for(|s| matches!(s, BrokerStatus::Down { .. }))
            .await
        {
            Ok(status) => match &*status {
                BrokerStatus::Down { since, .. } => Some(*since),
                _ => None,
            },
            Err(_) => None,
        };
        match since {
            Some(since) => since,
            // The sender lives as long as `self`: not reached; wait forever like an
            // outage that never comes.
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_told_once_and_ends_with_the_first_message_taken() {
        let health = BrokerHealth::default();
        let t0 = Instant::now();
        assert!(health.is_up());
        assert_eq!(health.took_message(t0), Change::None);

        assert_eq!(health.failed("connection refused", t0), Change::WentDown);
        assert_eq!(
            health.failed("again", t0 + Duration::from_secs(1)),
            Change::None
        );
        assert!(
            matches!(health.status(), BrokerStatus::Down { since, ref reason }
            if since == t0 && reason == "connection refused")
        );

        // The probe passes, but the next publish fails again: the same outage goes on.
        health.answered();
        assert!(matches!(health.status(), BrokerStatus::Recovering { .. }));
        assert!(!health.is_up());
        assert_eq!(
            health.failed("still down", t0 + Duration::from_secs(2)),
            Change::None
        );
        assert!(matches!(health.status(), BrokerStatus::Down { since, .. } if since == t0));

        health.answered();
        assert_eq!(
            health.took_message(t0 + Duration::from_secs(5)),
            Change::CameBack(Duration::from_secs(5))
        );
        assert!(health.is_up());
    }

    #[test]
    fn a_quiet_cycle_ends_an_outage_only_once_the_probe_passed() {
        let health = BrokerHealth::default();
        let t0 = Instant::now();
        health.failed("down", t0);
        // A claim that began before the outage found nothing: it proves nothing.
        assert_eq!(health.settled(t0), Change::None);
        assert!(health.is_down());
        health.answered();
        assert_eq!(
            health.settled(t0 + Duration::from_secs(3)),
            Change::CameBack(Duration::from_secs(3))
        );
        assert!(health.is_up());
    }

    #[tokio::test(start_paused = true)]
    async fn claims_wait_while_down_and_go_on_once_the_probe_passes() {
        let health = std::sync::Arc::new(BrokerHealth::default());
        let hour = Duration::from_secs(3600);
        let started = tokio::time::Instant::now();
        health.wait_claimable(hour).await;
        assert_eq!(started.elapsed(), Duration::ZERO, "no wait while up");

        let t0 = Instant::now();
        health.failed("down", t0);
        assert_eq!(health.wait_down().await, t0);
        health.wait_claimable(Duration::from_secs(10)).await;
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(10),
            "waits out its limit while down"
        );

        let waiting = tokio::spawn({
            let health = std::sync::Arc::clone(&health);
            async move { health.wait_claimable(hour).await }
        });
        // Let the task start waiting before the probe passes.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        health.answered();
        waiting.await.expect("task");
        assert!(
            started.elapsed() < hour,
            "claims went on when the probe passed, not at the limit"
        );
    }
}
