//! `outbox`: the standalone outbox relay and its administration commands.
//!
//! See `docs/operations.md` for running it and the configuration reference.

mod admin;
mod broker;
mod config;
mod db;
mod exporter;
mod failure;
mod http;
mod serve;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

use crate::failure::Failure;

/// The transactional outbox relay for PostgreSQL, with admin commands.
///
/// Settings come from the TOML file given with --config (or OUTBOX_CONFIG),
/// overridden by OUTBOX_* environment variables (OUTBOX_DATABASE_URL,
/// OUTBOX_BROKER, OUTBOX_BATCH_SIZE, ... and each broker's own variables).
#[derive(Debug, Parser)]
#[command(name = "outbox", version, propagate_version = true)]
struct Cli {
    /// Configuration file (TOML).
    #[arg(long, short, global = true, env = "OUTBOX_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    /// Log format on standard error. The level comes from OUTBOX_LOG or RUST_LOG
    /// (e.g. `info`, `pgoutbox_core=debug`).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "pretty",
        env = "OUTBOX_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish outbox events to the broker until SIGTERM/SIGINT; serves /metrics,
    /// /healthz and /readyz.
    Relay,
    /// Create or update the outbox schema (idempotent).
    Migrate(admin::MigrateArgs),
    /// Inspect, retry or purge dead letters.
    #[command(subcommand)]
    DeadLetters(admin::DeadLettersCommand),
    /// Pending, scheduled, in-flight and dead events, oldest pending age, recent throughput.
    Stats {
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Apply retention once: delete published rows and inbox records past their age.
    Cleanup,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("outbox: {failure}");
            ExitCode::from(failure.code)
        }
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    let default_level = match cli.command {
        Command::Relay => "info",
        _ => "warn",
    };
    init_logging(cli.log_format, default_level)?;
    let settings = config::load(cli.config.as_deref())?;
    // Broker settings are read (and validated) before the runtime starts: a bad one is a config error.
    let broker = match cli.command {
        Command::Relay => Some(broker::Spec::read(&settings)?),
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(async move {
        match (cli.command, broker) {
            (Command::Relay, Some(broker)) => serve::run(settings, broker).await,
            (Command::Relay, None) => Err(Failure::runtime("no broker configured")),
            (Command::Migrate(args), _) => admin::migrate(&settings, &args).await,
            (Command::DeadLetters(command), _) => admin::dead_letters(&settings, command).await,
            (Command::Stats { json }, _) => admin::stats(&settings, json).await,
            (Command::Cleanup, _) => admin::cleanup(&settings).await,
        }
    })
}

/// Log directive that silences lapin's warning per returned (unroutable) message.
const QUIET_LAPIN_RETURNS: &str = "lapin::returned_messages=error";
/// Log directive that keeps PostgreSQL's notices ("relation ... already exists,
/// skipping" from the idempotent migrations) below info.
const QUIET_POSTGRES_NOTICES: &str = "sqlx::postgres::notice=warn";

fn init_logging(format: LogFormat, default_level: &str) -> Result<(), Failure> {
    let (source, directives) = match (std::env::var("OUTBOX_LOG"), std::env::var("RUST_LOG")) {
        (Ok(v), _) if !v.trim().is_empty() => ("OUTBOX_LOG", v),
        (_, Ok(v)) if !v.trim().is_empty() => ("RUST_LOG", v),
        _ => ("default", default_level.to_string()),
    };
    let mut filter = EnvFilter::try_new(&directives)
        .map_err(|e| Failure::config(format!("{source}=`{directives}`: {e}")))?;
    if !directives.contains("lapin") {
        // lapin warns with the whole message (payload included) for every message the
        // broker returns as unroutable; the relay already logs that event's failure
        // once with its id, so lapin's line is only noise unless asked for.
        filter = filter.add_directive(QUIET_LAPIN_RETURNS.parse().expect("valid directive"));
    }
    if !directives.contains("sqlx") {
        filter = filter.add_directive(QUIET_POSTGRES_NOTICES.parse().expect("valid directive"));
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let installed = match format {
        LogFormat::Pretty => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|e| Failure::runtime(format!("cannot install the logger: {e}")))
}
