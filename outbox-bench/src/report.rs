//! `outbox-bench report`: every headline scenario in one command, on the binaries
//! of the current checkout, printed (and written as Markdown) as one table.
//!
//! Each scenario runs as a child process of this binary (`--json`), so that a
//! scenario's pools, tasks and memory end with it and the next one starts clean.
//! A scenario measures its two arms back to back in every round, the first arm
//! alternating from round to round; a scenario with one arm runs once per round.
//! The table gives min/median/max of each arm, the ratio of each round and their
//! median, and a verdict that is "inconclusive" when the rounds spread wider
//! than the median's margin to the target. Any scenario that fails ends the
//! report with its name and no table: a partial table would read as complete.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::stats::{ratios_per_round, Spread, Target, Verdict};
use crate::{progress, Result};

#[derive(Args, Debug)]
pub(crate) struct ReportArgs {
    /// Smaller sizes and shorter phases: about 6 minutes instead of 20 (3 rounds all the same).
    #[arg(long)]
    quick: bool,
    /// Also write the table as Markdown to this file.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write the measured rows as JSON to this file (for `--previous` of a later run).
    #[arg(long)]
    save: Option<PathBuf>,
    /// The `--save` file of an earlier run: each row then also shows that run's
    /// median and the spread between the two runs, and its verdict covers the
    /// rounds of both.
    #[arg(long)]
    previous: Option<PathBuf>,
    /// Run only these scenarios (names as in the table's first column; default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The `outbox` binary for the scenarios that run relay processes (default:
    /// `$CARGO_TARGET_DIR/release/outbox`, else `target/release/outbox`).
    #[arg(long)]
    binary: Option<PathBuf>,
}

/// One measured arm: a name and one value per round.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Arm {
    pub(crate) name: String,
    pub(crate) rounds: Vec<f64>,
}

/// One line of the table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Row {
    /// The scenario, as `--only` names it.
    pub(crate) scenario: String,
    /// What was measured, e.g. "1 aggregate, ordered vs unordered".
    pub(crate) name: String,
    /// The workload's shape: events, keys, publisher, table state.
    pub(crate) shape: String,
    pub(crate) unit: String,
    /// One arm (a value with a target) or two (a ratio first/second per round).
    pub(crate) arms: Vec<Arm>,
    /// None for rows that are context, not a claim.
    pub(crate) target: Option<Target>,
}

impl Row {
    /// What the verdict is about: the ratio per round of two arms, or the one
    /// arm's values.
    pub(crate) fn judged(&self) -> Vec<f64> {
        match self.arms.as_slice() {
            [one] => one.rounds.clone(),
            [a, b, ..] => ratios_per_round(&a.rounds, &b.rounds),
            [] => Vec::new(),
        }
    }

    fn verdict(&self, previous: Option<&Row>) -> Option<Verdict> {
        let mut values = self.judged();
        if let Some(p) = previous {
            values.extend(p.judged());
        }
        self.target.map(|t| Verdict::of(&values, t))
    }
}

/// Sizes of one report: full or `--quick`.
struct Sizes {
    quick: bool,
}

impl Sizes {
    fn pick<T>(&self, full: T, quick: T) -> T {
        if self.quick {
            quick
        } else {
            full
        }
    }
}

/// A headline scenario: how to run it and how to read its result.
struct Headline {
    name: &'static str,
    /// Child processes to run (1 when the scenario alternates its arms itself).
    invocations: usize,
    /// Arguments of invocation `i` (scenario name first).
    args: fn(&Sizes, usize) -> Vec<String>,
    /// The rows, from the JSON of every invocation.
    rows: fn(&[Value]) -> Result<Vec<Row>>,
}

const ROUNDS: usize = 3;

/// The brokers of the `brokers` rows and the events drained into each: about two
/// seconds' worth at each one's rate here (moto's SQS takes tens of events a second).
const BROKERS: [(&str, u64); 4] = [
    ("nats", 100_000),
    ("amqp", 20_000),
    ("kafka", 80_000),
    ("sqs", 200),
];

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_string()).collect()
}

/// Every headline scenario, in the order they run.
fn headlines() -> Vec<Headline> {
    vec![
        Headline {
            name: "drain",
            invocations: 1,
            args: |s, _| {
                let events = s.pick("200000", "50000");
                strings(&["drain", "--events", events, "--rounds", "3"])
            },
            rows: drain_rows,
        },
        Headline {
            name: "shapes",
            invocations: 1,
            args: |s, _| {
                strings(&[
                    "shapes",
                    "--events",
                    s.pick("100000", "20000"),
                    "--rounds",
                    "3",
                ])
            },
            rows: shapes_rows,
        },
        Headline {
            name: "backlog",
            invocations: 1,
            args: |s, _| {
                strings(&[
                    "backlog",
                    "--large",
                    s.pick("400000", "100000"),
                    "--small",
                    s.pick("40000", "20000"),
                    "--rounds",
                    "3",
                ])
            },
            rows: backlog_rows,
        },
        Headline {
            name: "scaling",
            invocations: 1,
            args: |s, _| {
                strings(&[
                    "scaling",
                    "--events",
                    s.pick("100000", "30000"),
                    "--rounds",
                    "3",
                ])
            },
            rows: scaling_rows,
        },
        Headline {
            name: "held",
            invocations: 1,
            args: |s, _| {
                strings(&[
                    "held",
                    "--events",
                    s.pick("100000", "20000"),
                    "--held",
                    s.pick("20000", "5000"),
                    "--rounds",
                    "3",
                ])
            },
            rows: held_rows,
        },
        Headline {
            name: "horizon",
            invocations: 1,
            args: |s, _| {
                strings(&[
                    "horizon",
                    "--duration-secs",
                    s.pick("20", "8"),
                    "--window-secs",
                    s.pick("5", "4"),
                    "--drain-events",
                    s.pick("50000", "10000"),
                    // One drain per arm and round: the three rounds give three.
                    "--drains",
                    "1",
                    "--rounds",
                    "3",
                ])
            },
            rows: horizon_rows,
        },
        Headline {
            name: "latency",
            invocations: ROUNDS,
            args: |s, _| {
                strings(&[
                    "latency",
                    "--modes",
                    "adaptive",
                    "--duration-secs",
                    s.pick("10", "4"),
                ])
            },
            rows: latency_rows,
        },
        Headline {
            name: "produce",
            invocations: ROUNDS,
            args: |s, _| {
                strings(&[
                    "produce",
                    "--modes",
                    "adaptive",
                    "--duration-secs",
                    s.pick("3", "2"),
                ])
            },
            rows: produce_rows,
        },
        Headline {
            name: "live",
            invocations: ROUNDS,
            // The relay counts in turn first.
            args: |s, i| {
                let relays = if i % 2 == 0 { "1,4" } else { "4,1" };
                strings(&[
                    "live",
                    "--relays",
                    relays,
                    "--duration-secs",
                    s.pick("10", "4"),
                ])
            },
            rows: live_rows,
        },
        Headline {
            name: "console",
            // Two invocations per round, console off and on, in turn first.
            invocations: 2 * ROUNDS,
            args: |s, i| {
                let console_first = (i / 2) % 2 == 1;
                let console = (i % 2 == 0) == console_first;
                let mut args = strings(&[
                    "live",
                    "--relays",
                    "1",
                    "--duration-secs",
                    s.pick("10", "4"),
                ]);
                if console {
                    args.push("--console".into());
                }
                args
            },
            rows: console_rows,
        },
        Headline {
            name: "brokers",
            // Three rounds per broker, the aggregate counts in turn first.
            invocations: BROKERS.len() * ROUNDS,
            args: |s, i| {
                let (broker, events) = BROKERS[i / ROUNDS];
                let counts = if (i % ROUNDS).is_multiple_of(2) {
                    "1,10000"
                } else {
                    "10000,1"
                };
                let events = if s.quick { events / 4 } else { events };
                let mut args = strings(&[
                    "drain-broker",
                    "--broker",
                    broker,
                    "--aggregate-counts",
                    counts,
                ]);
                args.extend([
                    "--events".to_string(),
                    events.to_string(),
                    "--with-null".into(),
                ]);
                args
            },
            rows: broker_rows,
        },
        Headline {
            name: "wal",
            invocations: ROUNDS,
            args: |s, _| {
                strings(&[
                    "wal",
                    "--duration-secs",
                    "2",
                    "--latency-secs",
                    s.pick("6", "3"),
                    "--backlog",
                    s.pick("50000", "10000"),
                ])
            },
            rows: wal_rows,
        },
    ]
}

/// Run the report: every selected headline, then the table.
pub(crate) async fn report(url: &str, args: &ReportArgs) -> Result<crate::Report> {
    let sizes = Sizes { quick: args.quick };
    let headlines = headlines();
    for name in &args.only {
        if !headlines.iter().any(|h| h.name == name) {
            let names: Vec<&str> = headlines.iter().map(|h| h.name).collect();
            return Err(format!(
                "report: no scenario `{name}` (there are: {})",
                names.join(", ")
            )
            .into());
        }
    }
    let previous: Vec<Row> = match &args.previous {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("report: cannot read --previous {}: {e}", path.display()))?;
            serde_json::from_str(&text).map_err(|e| {
                format!(
                    "report: --previous {} is not a saved report: {e}",
                    path.display()
                )
            })?
        }
        None => Vec::new(),
    };
    let exe = std::env::current_exe()?;
    let binary = crate::live::binary(args.binary.as_ref()).ok();
    let started = Instant::now();
    let mut rows = Vec::new();
    for headline in headlines
        .iter()
        .filter(|h| args.only.is_empty() || args.only.iter().any(|o| o == h.name))
    {
        let mut results = Vec::new();
        for i in 0..headline.invocations {
            let mut scenario_args = (headline.args)(&sizes, i);
            if let Some(binary) = &args.binary {
                if matches!(headline.name, "horizon" | "live" | "console") {
                    scenario_args.push("--binary".into());
                    scenario_args.push(binary.display().to_string());
                }
            }
            progress(format!(
                "report: {} ({}/{})",
                headline.name,
                i + 1,
                headline.invocations
            ));
            results.push(run_child(&exe, url, headline.name, &scenario_args)?);
        }
        let found = (headline.rows)(&results)
            .map_err(|e| format!("report: scenario `{}`: {e}", headline.name))?;
        rows.extend(found);
    }
    let took = started.elapsed();
    if let Some(path) = &args.save {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .map_err(|e| format!("report: cannot write --save {}: {e}", path.display()))?;
    }
    let header = Header {
        command: std::env::args().skip(1).collect::<Vec<_>>().join(" "),
        commit: commit(),
        binaries: binaries_line(&exe, binary.as_deref()),
        took,
        quick: args.quick,
    };
    let markdown = render(&header, &rows, &previous);
    if let Some(path) = &args.markdown {
        std::fs::write(path, &markdown)
            .map_err(|e| format!("report: cannot write --markdown {}: {e}", path.display()))?;
    }
    let verdicts: Vec<_> = rows
        .iter()
        .filter_map(|r| r.verdict(previous.iter().find(|p| same_row(p, r))))
        .collect();
    let count = |v: Verdict| verdicts.iter().filter(|x| **x == v).count();
    Ok(crate::Report {
        line: format!(
            "{markdown}\nreport: {} rows, {} met, {} not met, {} inconclusive, in {:.0} s",
            rows.len(),
            count(Verdict::Met),
            count(Verdict::NotMet),
            count(Verdict::Inconclusive),
            took.as_secs_f64()
        ),
        json: serde_json::json!({ "scenario": "report", "rows": rows }),
    })
}

fn same_row(a: &Row, b: &Row) -> bool {
    a.scenario == b.scenario && a.name == b.name
}

/// Run `outbox-bench --json <args>` and return its JSON object; an error naming
/// `scenario` when it fails or prints none.
fn run_child(exe: &Path, url: &str, scenario: &str, args: &[String]) -> Result<Value> {
    let output = Command::new(exe)
        .arg("--database-url")
        .arg(url)
        .arg("--json")
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("report: cannot start scenario `{scenario}`: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "report: scenario `{scenario}` failed ({}; its error is above); no table written",
            output.status
        )
        .into());
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The result line for people first, then the JSON object.
    let json = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("report: scenario `{scenario}` printed no JSON result"))?;
    Ok(serde_json::from_str(json)?)
}

/// The commit the report ran on (with `+changes` when the worktree differs).
fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short=10", "HEAD"]) {
        Some(hash) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{hash}+changes")
            } else {
                hash
            }
        }
        None => "unknown (not run in a git checkout)".into(),
    }
}

/// When the binaries were built: a report on binaries older than the checkout's
/// last commit measures old code.
fn binaries_line(exe: &Path, relay: Option<&Path>) -> String {
    let built = |path: &Path| {
        std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .map(|age| format!("{} built {} min ago", path.display(), age.as_secs() / 60))
    };
    let mut parts: Vec<String> = vec![built(exe).unwrap_or_else(|| exe.display().to_string())];
    if let Some(relay) = relay.and_then(built) {
        parts.push(relay);
    }
    parts.join("; ")
}

pub(crate) struct Header {
    command: String,
    commit: String,
    binaries: String,
    took: Duration,
    quick: bool,
}

/// The table, as Markdown.
pub(crate) fn render(header: &Header, rows: &[Row], previous: &[Row]) -> String {
    let machine = crate::machine::describe();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "`outbox-bench {}` on commit `{}`{}, {:.0} min; {machine}; {}.\n",
        header.command,
        header.commit,
        if header.quick { " (quick sizes)" } else { "" },
        header.took.as_secs_f64() / 60.0,
        header.binaries
    );
    out.push_str(
        "Each round measures both arms back to back, the first arm alternating from round \
         to round; the ratio is taken per round and the verdict is on its median (one-arm \
         rows: on the values), \"inconclusive\" when the rounds spread wider than the \
         median's margin to the target. Latency everywhere: from the producer's clock read \
         just before it sends COMMIT (before its INSERT when it autocommits) to the event's \
         arrival at the publisher or consumer, same clock, not clamped.\n\n",
    );
    let with_previous = !previous.is_empty();
    let _ = write!(
        out,
        "| scenario | shape | arm A: min / median / max | arm B: min / median / max | ratio A/B per round | median | target | verdict |"
    );
    if with_previous {
        out.push_str(" previous run's median | spread between runs |");
    }
    out.push('\n');
    out.push_str("|---|---|---|---|---|---|---|---|");
    if with_previous {
        out.push_str("---|---|");
    }
    out.push('\n');
    for row in rows {
        let arm = |i: usize| match row.arms.get(i) {
            Some(a) => {
                let s = Spread::of(&a.rounds);
                format!(
                    "{}: {} / **{}** / {} {}",
                    a.name,
                    number(s.min),
                    number(s.median),
                    number(s.max),
                    row.unit
                )
            }
            None => "—".into(),
        };
        let judged = row.judged();
        let median = Spread::of(&judged).median;
        let per_round = if row.arms.len() >= 2 {
            judged
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            "—".into()
        };
        let prev = previous.iter().find(|p| same_row(p, row));
        let verdict = row
            .verdict(prev)
            .map_or("context".to_string(), |v| v.name().to_string());
        let target = row.target.map_or("—".into(), |t| t.describe());
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {per_round} | **{}** | {target} | {verdict} |",
            row.name,
            row.shape,
            arm(0),
            arm(1),
            number(median)
        );
        if with_previous {
            match prev {
                Some(p) => {
                    let before = Spread::of(&p.judged()).median;
                    let _ = write!(
                        out,
                        " {} | {} |",
                        number(before),
                        number((median - before).abs())
                    );
                }
                None => out.push_str(" — | — |"),
            }
        }
        out.push('\n');
    }
    out
}

/// A figure with the precision it deserves.
fn number(value: f64) -> String {
    if value.is_nan() {
        "—".into()
    } else if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

// Reading each scenario's JSON.

fn field<'a>(json: &'a Value, key: &str) -> Result<&'a Value> {
    json.get(key)
        .ok_or_else(|| format!("no `{key}` in its result").into())
}

fn numbers(json: &Value, key: &str) -> Result<Vec<f64>> {
    field(json, key)?
        .as_array()
        .ok_or_else(|| format!("`{key}` is not a list"))?
        .iter()
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| format!("`{key}` holds a non-number").into())
        })
        .collect()
}

fn list<'a>(json: &'a Value, key: &str) -> Result<&'a Vec<Value>> {
    field(json, key)?
        .as_array()
        .ok_or_else(|| format!("`{key}` is not a list").into())
}

fn number_of(json: &Value, key: &str) -> Result<f64> {
    field(json, key)?
        .as_f64()
        .ok_or_else(|| format!("`{key}` is not a number").into())
}

fn text_of(json: &Value, key: &str) -> Result<String> {
    Ok(match field(json, key)? {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

fn only(results: &[Value]) -> Result<&Value> {
    results.first().ok_or_else(|| "no result".into())
}

fn arm(name: &str, rounds: Vec<f64>) -> Arm {
    Arm {
        name: name.into(),
        rounds,
    }
}

fn row(
    scenario: &str,
    name: impl Into<String>,
    shape: impl Into<String>,
    unit: &str,
    arms: Vec<Arm>,
    target: Option<Target>,
) -> Row {
    Row {
        scenario: scenario.into(),
        name: name.into(),
        shape: shape.into(),
        unit: unit.into(),
        arms,
        target,
    }
}

fn drain_rows(results: &[Value]) -> Result<Vec<Row>> {
    let j = only(results)?;
    Ok(vec![row(
        "drain",
        "drain: relay vs the same SQL without it",
        format!(
            "{} events over {} aggregates, ordered, null publisher, 1 relay, synchronous_commit {}",
            number_of(j, "events")?,
            number_of(j, "aggregates")?,
            text_of(j, "synchronous_commit")?
        ),
        "events/s",
        vec![
            arm("relay", numbers(j, "relay_rounds")?),
            arm("SQL limit", numbers(j, "limit_rounds")?),
        ],
        Some(Target::AtLeast(0.8)),
    )])
}

fn shapes_rows(results: &[Value]) -> Result<Vec<Row>> {
    let j = only(results)?;
    let events = number_of(j, "events")?;
    let stats = text_of(j, "stats")?;
    list(j, "shapes")?
        .iter()
        .map(|s| {
            Ok(row(
                "shapes",
                format!("shapes: {}, ordered vs unordered", text_of(s, "keys")?),
                format!("{events} events, null publisher, 1 relay, {stats}"),
                "events/s",
                vec![
                    arm("ordered", numbers(s, "ordered_rounds")?),
                    arm("unordered", numbers(s, "unordered_rounds")?),
                ],
                Some(Target::AtLeast(0.8)),
            ))
        })
        .collect()
}

fn backlog_rows(results: &[Value]) -> Result<Vec<Row>> {
    let j = only(results)?;
    Ok(vec![row(
        "backlog",
        "backlog: large vs small",
        format!(
            "{} vs {} events over {} aggregates, ordered, null publisher, analysed while full",
            number_of(j, "large")?,
            number_of(j, "small")?,
            number_of(j, "aggregates")?
        ),
        "events/s",
        vec![
            arm("large", numbers(j, "large_rounds")?),
            arm("small", numbers(j, "small_rounds")?),
        ],
        Some(Target::AtLeast(0.9)),
    )])
}

fn scaling_rows(results: &[Value]) -> Result<Vec<Row>> {
    let j = only(results)?;
    let (events, aggregates, relays) = (
        number_of(j, "events")?,
        number_of(j, "aggregates")?,
        number_of(j, "relays")?,
    );
    list(j, "states")?
        .iter()
        .map(|s| {
            Ok(row(
                "scaling",
                format!("scaling: {relays} relays vs 1, {}", text_of(s, "stats")?),
                format!("{events} events over {aggregates} aggregates, ordered, null publisher"),
                "events/s",
                vec![
                    arm(&format!("{relays} relays"), numbers(s, "relays_rounds")?),
                    arm("1 relay", numbers(s, "one_relay_rounds")?),
                ],
                Some(Target::AtLeast(0.8)),
            ))
        })
        .collect()
}

fn held_rows(results: &[Value]) -> Result<Vec<Row>> {
    let j = only(results)?;
    Ok(vec![row(
        "held",
        "held: other aggregates held vs none",
        format!(
            "{} events over {} aggregates, {} others held, null publisher",
            number_of(j, "events")?,
            number_of(j, "aggregates")?,
            number_of(j, "held")?
        ),
        "events/s",
        vec![
            arm("held", numbers(j, "held_rounds")?),
            arm("none held", numbers(j, "none_held_rounds")?),
        ],
        Some(Target::AtLeast(0.9)),
    )])
}

fn horizon_rows(results: &[Value]) -> Result<Vec<Row>> {
    let j = only(results)?;
    let runs = list(j, "runs")?;
    let of = |arm_name: &str, key: &str| -> Result<Vec<f64>> {
        runs.iter()
            .filter(|r| r.get("arm").and_then(Value::as_str) == Some(arm_name))
            .map(|r| number_of(r, key))
            .collect()
    };
    let windows = runs
        .first()
        .and_then(|r| r.get("windows"))
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let shape = format!(
        "`outbox` binary, {} events/s over {} aggregates, VACUUM every {} s, {} windows; \
         a REPEATABLE READ snapshot held the whole run vs none",
        number_of(j, "rate")?,
        number_of(j, "aggregates")?,
        number_of(j, "vacuum_every_secs")?,
        windows
    );
    Ok(vec![
        row(
            "horizon",
            "horizon: commit-to-publish p99, snapshot held vs not",
            shape.clone(),
            "ms",
            vec![
                arm("held", of("held", "p99_ms")?),
                arm("unheld", of("unheld", "p99_ms")?),
            ],
            Some(Target::AtMost(2.0)),
        ),
        row(
            "horizon",
            "horizon: drain after the traffic, snapshot held vs not",
            shape,
            "events/s",
            vec![
                arm("held", of("held", "drain_per_s")?),
                arm("unheld", of("unheld", "drain_per_s")?),
            ],
            Some(Target::AtLeast(0.8)),
        ),
    ])
}

fn latency_rows(results: &[Value]) -> Result<Vec<Row>> {
    let p99s = results
        .iter()
        .map(|j| {
            let mode = field(j, "modes")?
                .as_array()
                .and_then(|m| m.first())
                .ok_or("`modes` is empty")?;
            number_of(mode, "p99_ms")
        })
        .collect::<Result<Vec<_>>>()?;
    let j = only(results)?;
    Ok(vec![row(
        "latency",
        "latency: commit-to-publish p99, default wake-up (adaptive poll)",
        format!(
            "{} events/s for {} s, in-process relay, null publisher",
            number_of(j, "rate")?,
            number_of(j, "seconds")?
        ),
        "ms",
        vec![arm("p99", p99s)],
        Some(Target::AtMost(5.0)),
    )])
}

fn produce_rows(results: &[Value]) -> Result<Vec<Row>> {
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for j in results {
        without.push(number_of(j, "baseline_tx_per_s")?);
        let mode = field(j, "modes")?
            .as_array()
            .and_then(|m| m.first())
            .ok_or("`modes` is empty")?;
        with.push(number_of(mode, "tx_per_s")?);
    }
    let j = only(results)?;
    Ok(vec![row(
        "produce",
        "produce: producer transactions with the outbox vs without",
        format!(
            "{} writers for {} s, relay running (adaptive poll); baseline measured first",
            number_of(j, "writers")?,
            number_of(j, "seconds")?
        ),
        "tx/s",
        vec![arm("with event", with), arm("business row only", without)],
        Some(Target::AtLeast(0.9)),
    )])
}

fn live_rows(results: &[Value]) -> Result<Vec<Row>> {
    let mut by_relays: Vec<(u64, Vec<f64>)> = Vec::new();
    for j in results {
        for run in list(j, "runs")? {
            let relays = number_of(run, "relays")? as u64;
            let lost = number_of(run, "lost")?;
            if lost > 0.0 {
                return Err(format!("{lost} events lost with {relays} relay(s)").into());
            }
            let p99 = number_of(run, "p99_ms")?;
            match by_relays.iter_mut().find(|(r, _)| *r == relays) {
                Some((_, v)) => v.push(p99),
                None => by_relays.push((relays, vec![p99])),
            }
        }
    }
    by_relays.sort_by_key(|(r, _)| *r);
    let j = only(results)?;
    let shape = format!(
        "`outbox relay` processes into NATS JetStream, {} events/s for {} s, from an emptied, analysed table",
        number_of(j, "rate")?,
        number_of(j, "seconds")?
    );
    Ok(by_relays
        .into_iter()
        .map(|(relays, p99s)| {
            row(
                "live",
                format!("live: commit-to-delivery p99, {relays} relay(s)"),
                shape.clone(),
                "ms",
                vec![arm("p99", p99s)],
                Some(Target::AtMost(10.0)),
            )
        })
        .collect())
}

fn console_rows(results: &[Value]) -> Result<Vec<Row>> {
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for j in results {
        let run = list(j, "runs")?.first().ok_or("`runs` is empty")?;
        let p99 = number_of(run, "p99_ms")?;
        if field(j, "console")?.as_bool() == Some(true) {
            on.push(p99);
        } else {
            off.push(p99);
        }
    }
    let j = only(results)?;
    Ok(vec![row(
        "console",
        "console: live p99, console enabled and idle vs off",
        format!(
            "1 `outbox relay` process into NATS JetStream, {} events/s for {} s; target: within 25%",
            number_of(j, "rate")?,
            number_of(j, "seconds")?
        ),
        "ms",
        vec![arm("console on", on), arm("console off", off)],
        Some(Target::AtMost(1.25)),
    )])
}

fn broker_rows(results: &[Value]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for runs in results.chunks(ROUNDS) {
        let j = only(runs)?;
        let name = text_of(j, "broker")?;
        let (mut one, mut many, mut null) = (Vec::new(), Vec::new(), Vec::new());
        for run in runs {
            for rate in list(run, "rates")? {
                match number_of(rate, "aggregates")? as u64 {
                    1 => one.push(number_of(rate, "events_per_s")?),
                    _ => many.push(number_of(rate, "events_per_s")?),
                }
            }
            null.push(number_of(run, "null_events_per_s")?);
        }
        let shape = format!(
            "{} events, ordered, 1 relay, batch {}",
            number_of(j, "events")?,
            number_of(j, "batch_size")?
        );
        // SQS keeps one event per call for a run: no target (docs/design.md, "One batch").
        let target = (name != "SQS").then_some(Target::AtLeast(0.5));
        rows.push(row(
            "brokers",
            format!("{name}: 1 aggregate vs 10,000"),
            shape.clone(),
            "events/s",
            vec![
                arm("1 aggregate", one),
                arm("10,000 aggregates", many.clone()),
            ],
            target,
        ));
        rows.push(row(
            "brokers",
            format!("{name} vs null publisher, 10,000 aggregates"),
            format!("{shape}; the null publisher drained after the broker"),
            "events/s",
            vec![arm(&name, many), arm("null publisher", null)],
            None,
        ));
    }
    Ok(rows)
}

fn wal_rows(results: &[Value]) -> Result<Vec<Row>> {
    let (mut wal, mut table) = (Vec::new(), Vec::new());
    let (mut wal_tx, mut table_tx) = (Vec::new(), Vec::new());
    for j in results {
        let latency = list(j, "latency_ms")?;
        let p99 = |mode: &str| -> Result<f64> {
            let m = latency
                .iter()
                .find(|m| m.get("mode").and_then(Value::as_str) == Some(mode))
                .ok_or_else(|| format!("no `{mode}` in `latency_ms`"))?;
            number_of(m, "p99")
        };
        wal.push(p99("wal")?);
        table.push(p99("table")?);
        wal_tx.push(number_of(j, "wal_tx_per_s")?);
        table_tx.push(number_of(j, "table_tx_per_s")?);
    }
    let j = only(results)?;
    let rate = number_of(j, "rate")?;
    let writers = number_of(j, "writers")?;
    Ok(vec![
        row(
            "wal",
            "wal: commit-to-publish p99, WAL vs table mode",
            format!("{rate} events/s, in-process relay, null publisher, same latency clock"),
            "ms",
            vec![arm("WAL", wal), arm("table", table)],
            None,
        ),
        row(
            "wal",
            "wal: producer transactions, WAL vs table mode",
            format!("{writers} writers, relay running"),
            "tx/s",
            vec![arm("WAL", wal_tx), arm("table", table_tx)],
            None,
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_arms(a: &[f64], b: &[f64], target: Option<Target>) -> Row {
        row(
            "drain",
            "drain: relay vs the same SQL without it",
            "shape",
            "events/s",
            vec![arm("relay", a.to_vec()), arm("SQL limit", b.to_vec())],
            target,
        )
    }

    #[test]
    fn a_two_arm_row_is_judged_on_its_ratio_per_round() {
        let r = two_arms(
            &[90.0, 100.0, 80.0],
            &[100.0, 100.0, 100.0],
            Some(Target::AtLeast(0.5)),
        );
        assert_eq!(r.judged(), vec![0.9, 1.0, 0.8]);
        assert_eq!(r.verdict(None), Some(Verdict::Met));
        // Against 0.85 the median 0.9 passes, but the rounds spread 0.2 > 0.05.
        let r = two_arms(
            &[90.0, 100.0, 80.0],
            &[100.0, 100.0, 100.0],
            Some(Target::AtLeast(0.85)),
        );
        assert_eq!(r.verdict(None), Some(Verdict::Inconclusive));
        // A row without a target is context.
        assert_eq!(two_arms(&[1.0], &[1.0], None).verdict(None), None);
    }

    #[test]
    fn a_previous_run_widens_the_spread() {
        let now = two_arms(
            &[95.0, 100.0, 98.0],
            &[100.0; 3],
            Some(Target::AtLeast(0.8)),
        );
        assert_eq!(now.verdict(None), Some(Verdict::Met));
        let before = two_arms(
            &[60.0, 100.0, 98.0],
            &[100.0; 3],
            Some(Target::AtLeast(0.8)),
        );
        assert_eq!(now.verdict(Some(&before)), Some(Verdict::Inconclusive));
    }

    #[test]
    fn the_table_has_a_line_per_row_with_its_figures() {
        let header = Header {
            command: "report".into(),
            commit: "abc".into(),
            binaries: "b".into(),
            took: Duration::from_secs(60),
            quick: false,
        };
        let rows = vec![
            two_arms(
                &[90.0, 100.0, 80.0],
                &[100.0, 100.0, 100.0],
                Some(Target::AtLeast(0.5)),
            ),
            row(
                "latency",
                "latency p99",
                "s",
                "ms",
                vec![arm("p99", vec![3.0, 4.0, 3.5])],
                Some(Target::AtMost(5.0)),
            ),
        ];
        let text = render(&header, &rows, &[]);
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[1].contains("0.90, 1.00, 0.80") && lines[1].contains("| met |"),
            "{text}"
        );
        assert!(
            lines[2].contains("**3.50**") && lines[2].contains("<= 5"),
            "{text}"
        );
        // With a previous run: its median and the spread between the runs.
        let text = render(&header, &rows, &rows);
        assert!(text.contains("previous run's median"), "{text}");
    }

    #[test]
    fn every_scenario_reads_its_own_json() {
        let drain = serde_json::json!({
            "events": 10, "aggregates": 2, "synchronous_commit": true,
            "relay_rounds": [1.0, 2.0, 3.0], "limit_rounds": [1.0, 2.0, 3.0],
        });
        assert_eq!(
            drain_rows(&[drain]).unwrap()[0].judged(),
            vec![1.0, 1.0, 1.0]
        );
        let broken = serde_json::json!({ "events": 10 });
        let error = drain_rows(&[broken]).unwrap_err().to_string();
        assert!(error.contains("aggregates"), "{error}");
    }
}
