//! Placeholder: the amqp example is being written.
fn main() {}
