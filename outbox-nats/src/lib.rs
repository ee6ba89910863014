//! Placeholder: the nats publisher is being written.
