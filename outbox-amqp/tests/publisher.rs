//! The publisher against the real RabbitMQ beyond the conformance suites: a refused
//! login is an outage.

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
