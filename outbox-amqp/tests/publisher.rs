//! The publisher against the real RabbitMQ beyond the conformance suites: a refused
//! login is an outage; returns find their message among concurrent runs.

mod common;

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
    use std::collections::HashSet;

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
    let mut received = HashSet::new();
    while received.len() < reported.len() {
        let batch = target.get(1000, std::time::Duration::from_secs(10)).await;
        if batch.is_empty() {
            break;
        }
        received.extend(batch.into_iter().map(|(metadata, _)| metadata.event_id));
    }
    assert_eq!(
        received, reported,
        "the broker holds what was reported published"
    );
    target.delete().await;
}
