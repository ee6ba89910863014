//! Placeholder: the sqs publisher is being written.
