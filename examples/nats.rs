//! Placeholder: the nats example is being written.
fn main() {}
