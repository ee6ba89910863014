//! Placeholder: the sqs example is being written.
fn main() {}
