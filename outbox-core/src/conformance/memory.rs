//! A stand-in broker in memory, honest or broken on purpose: it shows that a
//! conformance check can fail (each check must pass with [`Fault::None`] and fail
//! with the fault it is meant to catch). Not a broker to test an adapter with.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::{BoxError, ConformanceTarget, OutageTarget, ReceivedMessage};
use crate::event::{Event, Headers};
use crate::publisher::{Outcome, PublishError, Publisher, RunOrder, RunOutcome};

/// How the stand-in publisher misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// An honest broker.
    None,
    /// Each message of a batch carries the body of the next event.
    RotatesBodies,
    /// A refused message fails, and arrives 500 ms later all the same.
    DeliversRefusedLate,
    /// Messages arrive without the event's headers.
    DropsHeaders,
    /// While the broker is down ([`OutageTarget::cut`]), messages fail as retryable
    /// and [`Publisher::check`] passes: a publisher that cannot tell an outage from
    /// failing messages.
    HidesOutages,
    /// The first message of every other batch (the 1st, the 3rd, ...) arrives 200 ms
    /// late, after messages of later batches.
    DelaysOddBatchHeads,
}

/// Marks the events the stand-in broker refuses ([`ConformanceTarget::refused`]).
const REFUSED: &str = "nowhere";

/// How late [`Fault::DelaysOddBatchHeads`] and [`Fault::DeliversRefusedLate`]
/// deliver.
const LATE: Duration = Duration::from_millis(200);

/// Messages "on the broker", in arrival order.
#[derive(Clone, Default)]
struct Queue(Arc<Mutex<VecDeque<ReceivedMessage>>>);

impl Queue {
    fn lock(&self) -> MutexGuard<'_, VecDeque<ReceivedMessage>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Deliver `message` after `delay`, on a task of its own.
    fn deliver_late(&self, message: ReceivedMessage, delay: Duration) {
        let queue = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            queue.lock().push_back(message);
        });
    }
}

/// The publisher of a [`MemoryBroker`].
pub struct MemoryPublisher {
    queue: Queue,
    fault: Fault,
    down: Arc<AtomicBool>,
    /// Batches published so far.
    batches: AtomicUsize,
}

impl MemoryPublisher {
    fn message(&self, event: &Event, body: &Event) -> ReceivedMessage {
        ReceivedMessage {
            id: event.id,
            event_type: event.event_type.clone(),
            aggregate_type: event.aggregate_type.clone(),
            aggregate_id: event.aggregate_id.clone(),
            created_at: Some(event.created_at),
            payload: body.payload_str().as_bytes().to_vec(),
            headers: match self.fault {
                Fault::DropsHeaders => Headers::new(),
                _ => event.headers.clone(),
            },
        }
    }
}

impl Publisher for MemoryPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        if self.down.load(Ordering::SeqCst) {
            let failed = if self.fault == Fault::HidesOutages {
                Outcome::retryable("no answer")
            } else {
                Outcome::unavailable("the broker is down")
            };
            return vec![failed; events.len()];
        }
        let mut outcomes = Vec::with_capacity(events.len());
        let odd_batch = self
            .batches
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(2);
        for (i, event) in events.iter().enumerate() {
            let body = match self.fault {
                Fault::RotatesBodies => &events[(i + 1) % events.len()],
                _ => event,
            };
            let message = self.message(event, body);
            if event.destination.as_deref() == Some(REFUSED) {
                if self.fault == Fault::DeliversRefusedLate {
                    self.queue.deliver_late(message, LATE);
                }
                outcomes.push(Outcome::permanent("no route to `nowhere`"));
                continue;
            }
            if i == 0 && odd_batch && self.fault == Fault::DelaysOddBatchHeads {
                self.queue.deliver_late(message, LATE);
            } else {
                self.queue.lock().push_back(message);
            }
            outcomes.push(Outcome::Published);
        }
        outcomes
    }

    async fn check(&self) -> Result<(), PublishError> {
        if self.down.load(Ordering::SeqCst) && self.fault != Fault::HidesOutages {
            return Err(PublishError::unavailable("the broker is down"));
        }
        Ok(())
    }

    fn run_order(&self) -> RunOrder {
        RunOrder::Pipelined
    }

    /// Event after event, yielding in between (so that an outage can begin in the
    /// middle of a run), up to the first failure.
    async fn publish_run(&self, run: &[Event]) -> RunOutcome {
        for (k, event) in run.iter().enumerate() {
            tokio::task::yield_now().await;
            let outcome = self.publish(std::slice::from_ref(event)).await;
            if let Some(Outcome::Failed(error)) = outcome.into_iter().next() {
                return RunOutcome::failed(k, error);
            }
        }
        RunOutcome::complete(run.len())
    }
}

/// A [`ConformanceTarget`] in memory with a [`Fault`]. Needs a Tokio runtime.
pub struct MemoryBroker {
    queue: Queue,
    fault: Fault,
    down: Arc<AtomicBool>,
}

impl MemoryBroker {
    /// A broker with this fault ([`Fault::None`]: an honest one).
    pub fn new(fault: Fault) -> Self {
        Self {
            queue: Queue::default(),
            fault,
            down: Arc::default(),
        }
    }
}

impl ConformanceTarget for MemoryBroker {
    type Publisher = MemoryPublisher;

    async fn publisher(&self) -> Result<MemoryPublisher, BoxError> {
        Ok(MemoryPublisher {
            queue: self.queue.clone(),
            fault: self.fault,
            down: Arc::clone(&self.down),
            batches: AtomicUsize::new(0),
        })
    }

    async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<ReceivedMessage>, BoxError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let batch: Vec<ReceivedMessage> = {
                let mut queue = self.queue.lock();
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

impl OutageTarget for MemoryBroker {
    async fn outage_publisher(&self) -> Result<MemoryPublisher, BoxError> {
        self.publisher().await
    }

    fn cut(&self) {
        self.down.store(true, Ordering::SeqCst);
    }

    fn restore(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}
