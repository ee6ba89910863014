//! Placeholder: the kafka publisher is being written.
