//! The `outbox` binary as a library: its whole command line (`relay`, `migrate`,
//! `dead-letters`, `stats`, `cleanup`), with brokers of your own next to the
//! built-in ones.
//!
//! The `outbox` binary is `App::new().main()`. A program that publishes somewhere
//! the built-in brokers do not reach adds its [`Publisher`](pgoutbox_core::Publisher)
//! under a broker kind, and gets the same relay, configuration, metrics, health
//! endpoints, shutdown and admin commands:
//!
//! ```no_run
//! use std::process::ExitCode;
//! use pgoutbox_core::StdoutPublisher;
//! use pgoutbox_relay::{App, BoxError};
//!
//! fn main() -> ExitCode {
//!     App::new()
//!         // `broker.kind = "audit-log"`; its settings are the `[broker.audit-log]` section.
//!         .broker("audit-log", |section: toml::Table| async move {
//!             let _path: Option<&str> = section.get("path").and_then(|v| v.as_str());
//!             Ok::<_, BoxError>(StdoutPublisher) // your publisher here
//!         })
//!         .main()
//! }
//! ```
//!
//! `examples/custom_broker.rs` in the repository is a complete one (a JSON-lines
//! file as the broker). See `docs/operations.md` for running the binary and the
//! configuration reference.

mod admin;
mod broker;
mod config;
mod console;
mod db;
mod dead_letters;
mod exporter;
mod failure;
mod history;
mod http;
mod members;
mod scrape;
mod serve;
mod targets;
mod wal_slot;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

use crate::broker::Brokers;
use crate::failure::Failure;

pub use crate::broker::{BoxError, BrokerError, BrokerFactory, BrokerInput, BuildFuture};
/// The TOML types a [`BrokerFactory`] receives its section as.
pub use toml;

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
    /// With several outboxes ([[outbox]], [tenants]): only the one of this name
    /// (its `name`, `schema.table` or schema), for `check`, `migrate`, `stats`,
    /// `cleanup` and `dead-letters`. Default: every outbox.
    #[arg(long, global = true, value_name = "NAME")]
    outbox: Option<String>,
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
    /// Check the configuration, the database (reachable, outbox migrated) and the
    /// broker (reachable), print what was checked, and exit: 0 when everything
    /// passes. Creates nothing.
    Check,
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

/// The `outbox` command line with the built-in brokers and any added with
/// [`App::broker`].
#[derive(Default)]
#[must_use]
pub struct App {
    brokers: Brokers,
}

impl App {
    /// The command line with the built-in brokers (those compiled in).
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a broker: `broker.kind = "<kind>"` (or `OUTBOX_BROKER=<kind>`) makes the
    /// relay publish with what `factory` builds from the `[broker.<kind>]` section.
    /// The built-in brokers are registered the same way. A factory that is a
    /// closure of the section gets no `[routing]` rules or `[envelope]` (the binary
    /// warns when some are configured); one that implements [`BrokerFactory`]
    /// reads them from its [`BrokerInput`].
    ///
    /// # Panics
    /// When `kind` is empty, the name of a built-in broker, or already added: a
    /// mistake in the program, not in its configuration.
    pub fn broker(mut self, kind: &str, factory: impl BrokerFactory + 'static) -> Self {
        assert!(!kind.trim().is_empty(), "a broker kind must not be empty");
        assert!(
            !Brokers::default().is_known(kind),
            "broker kind `{kind}` is built in; choose another name"
        );
        assert!(
            !self.brokers.is_known(kind),
            "broker kind `{kind}` was added twice"
        );
        self.brokers.add(kind, Arc::new(factory));
        self
    }

    /// Parse the process's arguments, run the command, and return its exit code
    /// (failures are printed as one line on standard error: `outbox: <message>`).
    pub fn main(self) -> ExitCode {
        let cli = Cli::parse();
        match run(cli, &self.brokers) {
            Ok(()) => ExitCode::SUCCESS,
            Err(failure) => {
                eprintln!("outbox: {failure}");
                ExitCode::from(failure.code)
            }
        }
    }
}

fn run(cli: Cli, brokers: &Brokers) -> Result<(), Failure> {
    let default_level = match cli.command {
        Command::Relay => "info",
        _ => "warn",
    };
    init_logging(cli.log_format, default_level)?;
    let settings = config::load(cli.config.as_deref())?;
    if let (Command::Relay, Some(_)) = (&cli.command, &cli.outbox) {
        return Err(Failure::config(
            "--outbox selects the outbox of an admin command; `outbox relay` relays every configured outbox",
        ));
    }
    let selector = cli.outbox.as_deref();
    brokers.check_sections(&settings)?;
    // Broker settings are read (and validated) before the runtime starts: a bad one is a config error.
    let broker = match cli.command {
        Command::Relay | Command::Check => Some(broker::Spec::read(&settings, brokers)?),
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the async runtime: {e}")))?;
    runtime.block_on(async move {
        match (cli.command, broker) {
            (Command::Relay, Some(broker)) => serve::run(settings, broker).await,
            (Command::Check, Some(broker)) => admin::check(&settings, broker, selector).await,
            (Command::Relay | Command::Check, None) => {
                Err(Failure::runtime("no broker configured"))
            }
            (Command::Migrate(args), _) => admin::migrate(&settings, &args, selector).await,
            (Command::DeadLetters(command), _) => {
                admin::dead_letters(&settings, &command, selector).await
            }
            (Command::Stats { json }, _) => admin::stats(&settings, json, selector).await,
            (Command::Cleanup, _) => admin::cleanup(&settings, selector).await,
        }
    })
}

/// Log directive that silences lapin's warning per returned (unroutable) message.
const QUIET_LAPIN_RETURNS: &str = "lapin::returned_messages=error";
/// Log directive that keeps PostgreSQL's notices ("relation ... already exists,
/// skipping" from the idempotent migrations) below info.
const QUIET_POSTGRES_NOTICES: &str = "sqlx::postgres::notice=warn";
/// Log directive that keeps the audit lines of dead-letter changes (from the
/// commands and the console) when the level is `warn`, the commands' default.
const KEEP_AUDIT: &str = "outbox::audit=info";

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
    if !directives.contains("audit") {
        filter = filter.add_directive(KEEP_AUDIT.parse().expect("valid directive"));
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
