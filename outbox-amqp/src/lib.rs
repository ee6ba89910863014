//! Placeholder: the amqp publisher is being written.
