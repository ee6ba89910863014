//! `outbox`: the standalone outbox relay and its administration commands.
//!
//! See `docs/operations.md` for running it and the configuration reference; the
//! `pgoutbox_relay` library runs the same command line with brokers of your own.

use std::process::ExitCode;

fn main() -> ExitCode {
    pgoutbox_relay::App::new().main()
}
