//! Placeholder: the kafka example is being written.
fn main() {}
