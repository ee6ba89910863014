//! The publisher against the real RabbitMQ beyond the conformance suites: a refused
//! login is an outage; returns find their message among concurrent runs.

mod common;

use std::collections::HashSet;

use common::{amqp_addr, url_via, AmqpTarget};
use pgoutbox_core::Publisher;

/// A refused login is the broker's failure, not the messages': no attempt counts.
#[tokio::test]
async fn a_wrong_password_is_an_outage_not_a_message_failure() {
    let target = AmqpTarget::new().await;
    let url = url_via(amqp_addr()).replace("guest:guest@", "guest:wrong-password@");
    let publisher = target
        .config(&url)
        .build()
        .expect("built; it connects on use");
    let events = vec![pgoutbox_core::conformance::claimed_event(
        "order",
        "o-1",
        "order.created",
        1,
    )];
    let outcomes = publisher.publish(&events).await;
    let error = match &outcomes[..] {
        [pgoutbox_core::Outcome::Failed(error)] => error.clone(),
        other => panic!("expected one failure, got {other:?}"),
    };
    assert!(error.is_unavailable(), "{error:?}");
    let check = publisher.check().await.expect_err("check must fail");
    assert!(check.is_unavailable(), "{check:?}");
    target.delete().await;
}

/// lapin hands a `basic.return` to whichever pending confirm of the channel the next
/// ack resolves first, which may be a message of another run sent at the same time.
/// An unroutable message among many runs published concurrently still fails, alone
/// and permanently, and the broker holds exactly the messages reported published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_among_concurrent_runs_fails_alone() {
    use pgoutbox_core::conformance::{claimed_event, ConformanceTarget};

    let target = AmqpTarget::new().await;
    let publisher = target.publisher().await.expect("connected to RabbitMQ");
    let mut reported = HashSet::new();
    for round in 0..20 {
        let runs: Vec<Vec<pgoutbox_core::Event>> = (0..24)
            .map(|i| {
                let mut run: Vec<_> = (0..3)
                    .map(|seq| {
                        claimed_event("order", &format!("r{round}-{i}"), "order.created", seq)
                    })
                    .collect();
                if i % 3 == 0 {
                    run[1] = target.refused(run[1].clone());
                }
                run
            })
            .collect();
        let outcomes =
            futures_util::future::join_all(runs.iter().map(|run| publisher.publish_run(run))).await;
        for (i, (run, outcome)) in runs.iter().zip(outcomes).enumerate() {
            let expected = if i % 3 == 0 { 1 } else { 3 };
            assert_eq!(
                outcome.published, expected,
                "round {round} run {i}: {outcome:?}"
            );
            match &outcome.failure {
                None => assert_eq!(
                    expected, 3,
                    "round {round} run {i}: the unroutable message was reported published"
                ),
                Some(error) => assert!(
                    !error.is_retryable() && error.message.contains("unroutable"),
                    "round {round} run {i}: {error:?}"
                ),
            }
            reported.extend(run[..expected].iter().map(|e| e.id));
        }
    }
    let received = received_ids(&target, reported.len()).await;
    assert_eq!(
        received, reported,
        "the broker holds what was reported published"
    );
    target.delete().await;
}

/// A broker that allows few channels (`channel_max`, here asked for in the URL)
/// makes concurrent runs wait for a confirm channel, not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_low_channel_max_makes_runs_wait_for_a_channel() {
    use pgoutbox_core::conformance::claimed_event;

    let target = AmqpTarget::new().await;
    // The topology channel and two confirm channels.
    let url = format!("{}?channel_max=3", common::amqp_url());
    let publisher = target.config(&url).build().expect("valid settings");
    let runs: Vec<Vec<pgoutbox_core::Event>> = (0..24)
        .map(|i| {
            (0..3)
                .map(|seq| claimed_event("order", &format!("c{i}"), "order.created", seq))
                .collect()
        })
        .collect();
    let outcomes =
        futures_util::future::join_all(runs.iter().map(|run| publisher.publish_run(run))).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        assert_eq!(
            (
                outcome.published,
                outcome.failure.as_ref().map(|e| &e.message)
            ),
            (3, None),
            "run {i}"
        );
    }
    let sent: HashSet<_> = runs.iter().flatten().map(|e| e.id).collect();
    let received = received_ids(&target, sent.len()).await;
    assert_eq!(received, sent);
    target.delete().await;
}

/// The event ids in the target's queue: until `expected` arrived, or none came
/// for 10 s.
async fn received_ids(target: &AmqpTarget, expected: usize) -> HashSet<uuid::Uuid> {
    let mut received = HashSet::new();
    while received.len() < expected {
        let batch = target.get(1000, std::time::Duration::from_secs(10)).await;
        if batch.is_empty() {
            break;
        }
        received.extend(batch.into_iter().map(|(metadata, _)| metadata.event_id));
    }
    received
}
