//! `outbox-bench report` fails loudly: a scenario that errors ends the report with
//! a non-zero exit and the scenario's name, and no table is printed or written.

use std::process::Command;

#[test]
fn a_failing_scenario_ends_the_report_without_a_table() {
    let dir = std::env::temp_dir().join(format!("outbox-bench-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let markdown = dir.join("report.md");
    // `drain` errors at once: nothing listens on port 1 (no PostgreSQL needed).
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
        .args(["report", "--quick", "--only", "drain,held", "--markdown"])
        .arg(&markdown)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "exit status {}", output.status);
    assert!(
        stderr.contains("scenario `drain` failed"),
        "the error names the scenario: {stderr}"
    );
    assert!(
        !stdout.contains("| scenario |"),
        "no partial table: {stdout}"
    );
    assert!(!markdown.exists(), "no Markdown file is written");
    // `held` was never started after `drain` failed.
    assert!(!stderr.contains("report: held"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_scenario_is_named() {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .args(["report", "--only", "drian"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("no scenario `drian`") && stderr.contains("drain"),
        "{stderr}"
    );
}
