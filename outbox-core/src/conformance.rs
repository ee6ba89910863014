//! Publisher conformance suite: placeholder, being written.
