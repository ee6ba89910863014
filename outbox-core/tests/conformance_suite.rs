//! The conformance suite's checks can fail: run against an in-memory broker, they
//! pass with an honest publisher and fail with publishers broken on purpose (one
//! that mixes up message bodies within a batch, one that reports a refused message
//! as failed but delivers it a little later). The suite's real users are the broker
//! crates, against their real brokers.

#![cfg(feature = "conformance")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgoutbox_core::conformance::{self, BoxError, ConformanceTarget, ReceivedMessage};
use pgoutbox_core::{Event, Outcome, Publisher};

/// How the stand-in publisher misbehaves.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// Each message of a batch carries the body of the next event.
    RotatesBodies,
    /// A refused message fails, and arrives 500 ms later all the same.
    DeliversRefusedLate,
}

/// Messages "on the broker", in publish order.
type Queue = Arc<Mutex<VecDeque<ReceivedMessage>>>;

struct MemoryPublisher {
    queue: Queue,
    fault: Fault,
}

/// Marks the events the stand-in broker refuses.
const REFUSED: &str = "nowhere";

fn message(event: &Event, body: &Event) -> ReceivedMessage {
    ReceivedMessage {
        id: event.id,
        event_type: event.event_type.clone(),
        aggregate_type: event.aggregate_type.clone(),
        aggregate_id: event.aggregate_id.clone(),
        created_at: Some(event.created_at),
        payload: body.payload_str().as_bytes().to_vec(),
        headers: event.headers.clone(),
    }
}

impl Publisher for MemoryPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            let body = match self.fault {
                Fault::RotatesBodies => &events[(i + 1) % events.len()],
                _ => event,
            };
            if event.destination.as_deref() == Some(REFUSED) {
                if self.fault == Fault::DeliversRefusedLate {
                    let queue = Arc::clone(&self.queue);
                    let late = message(event, body);
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        queue.lock().unwrap().push_back(late);
                    });
                }
                outcomes.push(Outcome::permanent("no route to `nowhere`"));
                continue;
            }
            self.queue.lock().unwrap().push_back(message(event, body));
            outcomes.push(Outcome::Published);
        }
        outcomes
    }
}

struct MemoryBroker {
    queue: Queue,
    fault: Fault,
}

impl MemoryBroker {
    fn new(fault: Fault) -> Self {
        Self {
            queue: Queue::default(),
            fault,
        }
    }
}

impl ConformanceTarget for MemoryBroker {
    type Publisher = MemoryPublisher;

    async fn publisher(&self) -> Result<MemoryPublisher, BoxError> {
        Ok(MemoryPublisher {
            queue: Arc::clone(&self.queue),
            fault: self.fault,
        })
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let batch: Vec<ReceivedMessage> = {
                let mut queue = self.queue.lock().unwrap();
                let n = max.min(queue.len());
                queue.drain(..n).collect()
            };
            if !batch.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(batch);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn refused(&self, mut event: Event) -> Event {
        event.destination = Some(REFUSED.to_string());
        event
    }

    async fn unreachable_publisher(&self) -> Result<MemoryPublisher, BoxError> {
        Err("no unreachable broker in memory".into())
    }
}

/// Whether `check` panics (fails) against `broker`.
async fn fails<F, Fut>(broker: MemoryBroker, check: F) -> bool
where
    F: FnOnce(Arc<MemoryBroker>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let run = tokio::spawn(check(Arc::new(broker)));
    match run.await {
        Ok(()) => false,
        Err(e) => e.is_panic(),
    }
}

#[tokio::test]
async fn read_back_fails_when_messages_carry_other_bodies() {
    let check = |b: Arc<MemoryBroker>| async move { conformance::publish_and_read_back(&*b).await };
    assert!(!fails(MemoryBroker::new(Fault::None), check).await);
    assert!(fails(MemoryBroker::new(Fault::RotatesBodies), check).await);
}

#[tokio::test]
async fn refused_message_check_fails_when_it_arrives_late() {
    let check =
        |b: Arc<MemoryBroker>| async move { conformance::refused_message_fails_alone(&*b).await };
    assert!(!fails(MemoryBroker::new(Fault::None), check).await);
    assert!(fails(MemoryBroker::new(Fault::DeliversRefusedLate), check).await);
}
