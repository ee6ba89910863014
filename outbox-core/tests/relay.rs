//! The relay engine against the in-memory store and publisher.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgoutbox_core::testing::{event, MemoryStore, RecordingPublisher};
use pgoutbox_core::{NewEvent, PublishError, Relay, RelayConfig, RetryPolicy};

fn config(batch_size: usize) -> RelayConfig {
    RelayConfig::default()
        .batch_size(batch_size)
        .poll_interval(Duration::from_millis(5))
        .retry(
            RetryPolicy::default()
                .base_delay(Duration::ZERO)
                .max_delay(Duration::ZERO),
        )
}

/// A publisher whose publish never returns.
struct Hang;

impl pgoutbox_core::Publisher for Hang {
    async fn publish(&self, _: &[pgoutbox_core::Event]) -> Vec<pgoutbox_core::Outcome> {
        std::future::pending().await
    }
}

/// Run the relay until the store has nothing pending or `limit` passes.
async fn run_until_drained<P: pgoutbox_core::Publisher>(relay: &Relay<MemoryStore, P>) {
    let store = relay.store().clone();
    let drained = async move {
        for _ in 0..2000 {
            if pgoutbox_core::Store::pending(&store).await.unwrap_or(1) == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    relay.run(drained).await;
}

#[tokio::test]
async fn backlog_is_drained_batch_after_batch_without_waiting() {
    let store = MemoryStore::new().with_ordering(false);
    for n in 0..1000 {
        store.enqueue(event(&format!("a{n}"), n)).unwrap();
    }
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(store.clone(), Arc::clone(&publisher))
        .with_config(config(100).poll_interval(Duration::from_secs(3600)));
    // With an hour-long poll interval, only back-to-back claims can drain this.
    tokio::time::timeout(Duration::from_secs(10), async {
        while store.published_ids().len() < 1000 {
            relay.run_once().await.unwrap();
        }
    })
    .await
    .unwrap();
    let stats = relay.stats().snapshot();
    assert_eq!(stats.batches, 10);
    assert_eq!(stats.published, 1000);
    assert_eq!(publisher.calls(), 10);
}

#[tokio::test]
async fn run_loop_drains_without_poll_ticks() {
    let store = MemoryStore::new().with_ordering(false);
    for n in 0..1000 {
        store.enqueue(event(&format!("a{n}"), n)).unwrap();
    }
    let relay = Relay::new(store.clone(), RecordingPublisher::new())
        .with_config(config(100).poll_interval(Duration::from_secs(3600)));
    tokio::time::timeout(Duration::from_secs(10), run_until_drained(&relay))
        .await
        .unwrap();
    let stats = relay.stats().snapshot();
    assert_eq!(stats.published, 1000);
    assert_eq!(stats.batches, 10);
    // 10 full batches and at most one empty claim before the shutdown.
    assert!(stats.claims <= 11, "{stats:?}");
}

#[tokio::test]
async fn a_hot_aggregate_goes_out_in_one_call_when_ordering_is_off() {
    // Ordering on: one wave per event of the aggregate, each after the previous.
    let ordered = MemoryStore::new();
    for n in 0..5 {
        ordered.enqueue(event("hot", n)).unwrap();
    }
    let relay = Relay::new(ordered.clone(), RecordingPublisher::new()).with_config(config(10));
    assert_eq!(relay.run_once().await.unwrap().published, 5);
    assert_eq!(relay.publisher().calls(), 5);

    // Ordering off: nothing to keep in order, so the claim is one call, and a
    // failure holds nothing back.
    let unordered = MemoryStore::new().with_ordering(false);
    let ids: Vec<_> = (0..5)
        .map(|n| unordered.enqueue(event("hot", n)).unwrap())
        .collect();
    let publisher = RecordingPublisher::failing_once(ids[1], "broker busy");
    let relay = Relay::new(unordered.clone(), publisher).with_config(config(10));
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.published, report.retried, report.held_back),
        (4, 1, 0)
    );
    assert_eq!(relay.publisher().calls(), 1);
}

#[tokio::test]
async fn failed_event_is_retried_and_does_not_hold_back_others() {
    let store = MemoryStore::new();
    let flaky = store.enqueue(event("a", 0)).unwrap();
    let healthy: Vec<_> = (1..5)
        .map(|n| store.enqueue(event(&format!("b{n}"), n)).unwrap())
        .collect();
    let publisher = RecordingPublisher::failing_once(flaky, "broker busy");
    let relay = Relay::new(store.clone(), publisher).with_config(config(10));

    let first = relay.run_once().await.unwrap();
    assert_eq!((first.published, first.retried), (4, 1));
    assert_eq!(store.attempts(flaky), Some((1, Some("broker busy".into()))));
    assert_eq!(relay.publisher().published_ids(), healthy);

    let second = relay.run_once().await.unwrap();
    assert_eq!(second.published, 1);
    assert!(store.published_ids().contains(&flaky));
}

#[tokio::test]
async fn permanent_error_dead_letters_at_once() {
    let store = MemoryStore::new();
    let bad = store.enqueue(event("a", 0)).unwrap();
    let publisher = RecordingPublisher::failing_when(move |e| {
        (e.id == bad).then(|| PublishError::permanent("message too large"))
    });
    let relay = Relay::new(store.clone(), publisher).with_config(config(10));
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(store.dead_letter_ids(), vec![bad]);
    let (attempts, error) = store.attempts(bad).unwrap();
    assert_eq!(attempts, 1);
    assert!(error.unwrap().contains("message too large"));
}

#[tokio::test]
async fn retryable_error_dead_letters_after_max_attempts() {
    let store = MemoryStore::new();
    let bad = store.enqueue(event("a", 0)).unwrap();
    let publisher =
        RecordingPublisher::failing_when(|_| Some(PublishError::retryable("connection refused")));
    let mut cfg = config(10);
    cfg.retry = cfg.retry.max_attempts(3);
    let relay = Relay::new(store.clone(), publisher).with_config(cfg);
    for _ in 0..3 {
        store.make_all_due();
        relay.run_once().await.unwrap();
    }
    assert_eq!(store.dead_letter_ids(), vec![bad]);
    let (attempts, error) = store.attempts(bad).unwrap();
    assert_eq!(attempts, 3);
    assert!(error
        .unwrap()
        .contains("gave up after 3 attempts: connection refused"));
}

#[tokio::test]
async fn ordering_holds_back_only_the_failing_aggregate() {
    let store = MemoryStore::new();
    let a1 = store.enqueue(event("a", 1)).unwrap();
    let a2 = store.enqueue(event("a", 2)).unwrap();
    let b1 = store.enqueue(event("b", 1)).unwrap();
    let b2 = store.enqueue(event("b", 2)).unwrap();
    let publisher = RecordingPublisher::failing_when(move |e| {
        (e.id == a1).then(|| PublishError::retryable("down"))
    });
    let mut cfg = config(10);
    cfg.retry = RetryPolicy::default().base_delay(Duration::from_secs(60));
    let relay = Relay::new(store.clone(), publisher).with_config(cfg);
    relay.run_once().await.unwrap();
    relay.run_once().await.unwrap();
    assert_eq!(relay.publisher().published_ids(), vec![b1, b2]);
    assert!(!store.published_ids().contains(&a2));
}

#[tokio::test]
async fn publisher_returning_too_few_outcomes_means_retry_not_loss() {
    struct Short;
    impl pgoutbox_core::Publisher for Short {
        async fn publish(&self, _: &[pgoutbox_core::Event]) -> Vec<pgoutbox_core::Outcome> {
            Vec::new()
        }
    }
    let store = MemoryStore::new();
    let id = store.enqueue(event("a", 0)).unwrap();
    let relay = Relay::new(store.clone(), Short).with_config(config(10));
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.retried, 1);
    assert_eq!(store.attempts(id).unwrap().0, 1);
}

#[tokio::test]
async fn hanging_publisher_is_bounded_by_publish_timeout() {
    let store = MemoryStore::new();
    let id = store.enqueue(event("a", 0)).unwrap();
    let mut cfg = config(10);
    cfg.publish_timeout = Duration::from_millis(50);
    let relay = Relay::new(store.clone(), Hang).with_config(cfg);
    let report = tokio::time::timeout(Duration::from_secs(5), relay.run_once())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.retried, 1);
    let (_, error) = store.attempts(id).unwrap();
    assert!(error.unwrap().contains("did not finish within"));
}

#[tokio::test]
async fn shutdown_returns_promptly_when_idle() {
    let store = MemoryStore::new();
    let relay = Relay::new(store, RecordingPublisher::new()).with_config(
        RelayConfig::default()
            .poll_interval(Duration::from_secs(3600))
            .pending_refresh(Duration::from_secs(3600)),
    );
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = relay.run(async {
        let _ = rx.await;
    });
    tokio::pin!(run);
    // Let the relay reach its idle wait, then stop it.
    assert!(tokio::time::timeout(Duration::from_millis(50), &mut run)
        .await
        .is_err());
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), run)
        .await
        .unwrap();
}

/// The store learns once that the relay stopped, after its loops ended (the
/// PostgreSQL store then leaves the relays table), not once per loop.
#[tokio::test]
async fn a_relay_tells_its_store_once_that_it_stopped() {
    let store = MemoryStore::new();
    for n in 0..50 {
        store.enqueue(event(&format!("a{n}"), n)).unwrap();
    }
    let relay =
        Relay::new(store.clone(), RecordingPublisher::new()).with_config(config(10).workers(3));
    assert_eq!(store.stops(), 0);
    run_until_drained(&relay).await;
    assert_eq!(store.stops(), 1);
}

#[tokio::test]
async fn a_run_is_published_in_order_and_held_back_after_a_failure() {
    let store = MemoryStore::new();
    let run: Vec<_> = (0..6)
        .map(|n| store.enqueue(event("a", n)).unwrap())
        .collect();
    let other: Vec<_> = (0..3)
        .map(|n| store.enqueue(event("b", n)).unwrap())
        .collect();
    let third = run[2];
    let publisher = RecordingPublisher::failing_once(third, "broker busy");
    let relay = Relay::new(store.clone(), publisher).with_config(config(100));

    let first = relay.run_once().await.unwrap();
    assert_eq!(first.claimed, 9, "one claim takes both runs");
    assert_eq!((first.published, first.retried, first.held_back), (5, 1, 3));
    let published = relay.publisher().published_ids();
    assert_eq!(
        published
            .iter()
            .filter(|id| run.contains(id))
            .collect::<Vec<_>>(),
        vec![&run[0], &run[1]],
        "the run stops at its failed third event"
    );
    assert!(
        other.iter().all(|id| published.contains(id)),
        "the other aggregate is unaffected"
    );
    assert_eq!(store.attempts(third), Some((1, Some("broker busy".into()))));
    for held in &run[3..] {
        assert_eq!(
            store.attempts(*held),
            Some((0, None)),
            "held back: no attempt counted"
        );
    }

    let second = relay.run_once().await.unwrap();
    assert_eq!(second.published, 4);
    let all = relay.publisher().published_ids();
    let order: Vec<_> = all.iter().filter(|id| run.contains(id)).copied().collect();
    assert_eq!(
        order, run,
        "every event of the run once, in insertion order"
    );
}

#[tokio::test]
async fn no_publish_call_holds_two_events_of_one_aggregate() {
    let store = MemoryStore::new();
    for n in 0..40 {
        store.enqueue(event(&format!("a{}", n % 3), n)).unwrap();
    }
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(store.clone(), Arc::clone(&publisher)).with_config(config(100));
    assert_eq!(relay.run_once().await.unwrap().published, 40);
    // 40 events over 3 aggregates: runs of 14, 13 and 13, so 14 waves.
    assert_eq!(publisher.calls(), 14);
    let published = publisher.published();
    for aggregate in ["a0", "a1", "a2"] {
        let ns: Vec<u64> = published
            .iter()
            .filter(|e| e.aggregate_id == aggregate)
            .map(|e| {
                serde_json::from_str::<serde_json::Value>(e.payload_str()).unwrap()["n"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        let mut sorted = ns.clone();
        sorted.sort_unstable();
        assert_eq!(ns, sorted, "order of {aggregate}");
    }
}

#[tokio::test]
async fn a_run_cut_by_the_publish_timeout_is_held_back_not_failed() {
    struct SlowAfterFirst(AtomicU32);
    impl pgoutbox_core::Publisher for SlowAfterFirst {
        async fn publish(&self, events: &[pgoutbox_core::Event]) -> Vec<pgoutbox_core::Outcome> {
            if self.0.fetch_add(1, Ordering::SeqCst) > 0 {
                std::future::pending::<()>().await;
            }
            vec![pgoutbox_core::Outcome::Published; events.len()]
        }
    }
    let store = MemoryStore::new();
    let ids: Vec<_> = (0..4)
        .map(|n| store.enqueue(event("a", n)).unwrap())
        .collect();
    let mut cfg = config(10);
    cfg.publish_timeout = Duration::from_millis(100);
    let relay = Relay::new(store.clone(), SlowAfterFirst(AtomicU32::new(0))).with_config(cfg);
    let report = tokio::time::timeout(Duration::from_secs(5), relay.run_once())
        .await
        .unwrap()
        .unwrap();
    // First wave published, second timed out (outcome unknown: an attempt), rest not sent.
    assert_eq!(
        (report.published, report.retried, report.held_back),
        (1, 1, 2)
    );
    assert_eq!(store.published_ids(), vec![ids[0]]);
    assert_eq!(store.attempts(ids[1]).unwrap().0, 1);
    assert_eq!(store.attempts(ids[2]).unwrap().0, 0);
    assert_eq!(store.attempts(ids[3]).unwrap().0, 0);
}

/// A claim loop whose publish never returns stops finishing cycles; a loop that
/// only waits for events keeps finishing them; a stopped relay has no answer.
#[tokio::test]
async fn liveness_tells_a_stuck_claim_loop_from_an_idle_one() {
    let now = std::time::Instant::now;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // Idle: nothing to claim, a 5 ms poll interval.
    let idle = Relay::new(MemoryStore::new(), RecordingPublisher::new()).with_config(config(10));
    let idle_liveness = idle.liveness();
    let idle_stats = idle.stats();
    assert_eq!(idle_liveness.stalled_for(now()), None, "not running yet");
    let idle_run = idle.run(until_stopped(stopped.clone()));

    // Stuck: the publish of its first batch never returns (no publish timeout to speak of).
    let store = MemoryStore::new();
    store.enqueue(event("a", 0)).unwrap();
    let mut cfg = config(10);
    cfg.publish_timeout = Duration::from_secs(3600);
    let stuck = Relay::new(store, Hang).with_config(cfg);
    let stuck_liveness = stuck.liveness();
    let stuck_stats = stuck.stats();
    let stuck_run = stuck.run(until_stopped(stopped.clone()));

    let check = async {
        // Wait (bounded) until the stuck loop has gone 300 ms without a cycle.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if stuck_liveness
                .stalled_for(now())
                .is_some_and(|d| d >= Duration::from_millis(300))
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "never seen stuck");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            stuck_stats.snapshot().batches,
            1,
            "stuck in its first batch"
        );
        // The idle loop finished a cycle after `mark` (a claim starts only after the
        // previous cycle finished): it has not been stalled since before `mark`,
        // although it has run for longer.
        let mark = now();
        let claims = idle_stats.snapshot().claims;
        while idle_stats.snapshot().claims < claims + 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the idle loop stopped claiming"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let at = now();
        let idle_for = idle_liveness.stalled_for(at).unwrap();
        assert!(
            idle_for <= at - mark,
            "idle loop stalled for {idle_for:?}, more than the {:?} since a cycle ended",
            at - mark
        );
        stop.send(true).unwrap();
    };
    // The stuck relay's batch never finishes; its run is dropped after the check.
    tokio::select! {
        _ = async { tokio::join!(check, idle_run) } => {}
        () = stuck_run => panic!("the stuck relay returned"),
    }
    assert_eq!(idle_liveness.stalled_for(now()), None, "stopped");
}

/// A publisher chosen at run time, behind `Arc<dyn DynPublisher>`, drives the relay
/// like the concrete one: every event published, in order, through the boxed calls,
/// and its failures keep their kind.
#[tokio::test]
async fn boxed_publisher_drives_the_relay() {
    use pgoutbox_core::{DynPublisher, Event, Outcome, Publisher};

    /// Refuses one event type, publishes the rest.
    struct Picky {
        inner: Arc<RecordingPublisher>,
    }

    impl Publisher for Picky {
        async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
            let mut outcomes = self.inner.publish(events).await;
            for (event, outcome) in events.iter().zip(&mut outcomes) {
                if event.event_type == "order.refused" {
                    *outcome = Outcome::permanent("refused by the test");
                }
            }
            outcomes
        }

        async fn check(&self) -> Result<(), PublishError> {
            Err(PublishError::unavailable("checked through the box"))
        }
    }

    let store = MemoryStore::new();
    let mut ids = Vec::new();
    let mut runs = vec![Vec::new(); 3];
    for n in 0..20 {
        let event = event(&format!("a{}", n % 3), n);
        ids.push(event.id);
        runs[n % 3].push(event.id);
        store.enqueue(event).unwrap();
    }
    let refused = NewEvent::new("order", "b", "order.refused", &serde_json::json!({}));
    store.enqueue(refused.clone()).unwrap();
    let recorder = Arc::new(RecordingPublisher::new());
    let publisher: Arc<dyn DynPublisher> = Arc::new(Picky {
        inner: Arc::clone(&recorder),
    });
    let check = publisher.check().await.unwrap_err();
    assert!(check.is_unavailable(), "{check:?}");

    let relay = Relay::new(store.clone(), Arc::clone(&publisher)).with_config(config(7));
    run_until_drained(&relay).await;
    assert_eq!(store.published_ids(), ids);
    assert_eq!(store.dead_letter_ids(), vec![refused.id]);
    pgoutbox_core::testing::check_first_arrivals(&recorder.published_ids(), &runs).unwrap();
}

/// A pipelining publisher over a [`RecordingPublisher`]: records the length of each
/// run it is handed, and fails the run's event `fail_id` once.
struct Pipelining {
    inner: RecordingPublisher,
    runs: std::sync::Mutex<Vec<usize>>,
    fail_id: std::sync::Mutex<Option<uuid::Uuid>>,
}

impl pgoutbox_core::Publisher for Pipelining {
    async fn publish(&self, events: &[pgoutbox_core::Event]) -> Vec<pgoutbox_core::Outcome> {
        self.inner.publish(events).await
    }

    fn run_order(&self) -> pgoutbox_core::RunOrder {
        pgoutbox_core::RunOrder::Pipelined
    }

    async fn publish_run(&self, run: &[pgoutbox_core::Event]) -> pgoutbox_core::RunOutcome {
        self.runs.lock().unwrap().push(run.len());
        let fail = self.fail_id.lock().unwrap().take();
        match fail.and_then(|id| run.iter().position(|e| e.id == id)) {
            Some(k) => {
                let head = self.inner.publish(&run[..k]).await;
                assert!(head.iter().all(|o| o == &pgoutbox_core::Outcome::Published));
                pgoutbox_core::RunOutcome::failed(k, PublishError::retryable("injected"))
            }
            None => pgoutbox_core::RunOutcome::from_outcomes(self.inner.publish(run).await),
        }
    }
}

#[tokio::test]
async fn pipelining_publisher_gets_each_run_whole_and_the_rest_in_one_call() {
    let store = MemoryStore::new();
    let mut ids = Vec::new();
    for n in 0..10 {
        let e = event("hot", n);
        ids.push(e.id);
        store.enqueue(e).unwrap();
    }
    store.enqueue(event("b", 0)).unwrap();
    store.enqueue(event("c", 0)).unwrap();
    let failing = ids[4];
    let publisher = Arc::new(Pipelining {
        inner: RecordingPublisher::new(),
        runs: std::sync::Mutex::default(),
        fail_id: std::sync::Mutex::new(Some(failing)),
    });
    let relay = Relay::new(store.clone(), Arc::clone(&publisher)).with_config(config(100));

    let first = relay.run_once().await.unwrap();
    assert_eq!(first.claimed, 12);
    assert_eq!(
        (first.published, first.retried, first.held_back),
        (6, 1, 5),
        "the run's head of four and both singles published, the fifth retried, the rest held back: {first:?}"
    );
    assert_eq!(publisher.runs.lock().unwrap().as_slice(), &[10]);
    // The singles went out in one `publish` call, the run's head in another.
    assert_eq!(publisher.inner.calls(), 2);

    let second = relay.run_once().await.unwrap();
    assert_eq!((second.claimed, second.published), (6, 6), "{second:?}");
    assert_eq!(publisher.runs.lock().unwrap().as_slice(), &[10, 6]);
    let hot: Vec<uuid::Uuid> = publisher
        .inner
        .published_ids()
        .into_iter()
        .filter(|id| ids.contains(id))
        .collect();
    assert_eq!(hot, ids, "the hot run in insertion order, each once");
}
