//! `reprise report` run as the real binary on a request log written here: the markdown's
//! numbers (counts, hit rate, savings, latency targets, top questions), its filters
//! (`--since`, `--until`, `--tenant`), rotated files, and the HTML page with its charts.

use std::path::Path;
use std::process::Command;

/// 2026-01-01T00:00:00Z.
const T: u64 = 1_767_225_600_000;
const HOUR: u64 = 3_600_000;

fn log_lines() -> Vec<String> {
    let saved = |p: u32, c: u32, ms: u32, cost: f64| {
        format!(
            r#""saved_prompt_tokens":{p},"saved_completion_tokens":{c},"saved_backend_ms":{ms},"saved_cost":{cost}"#
        )
    };
    vec![
        // First hour: acme misses, hits exactly, and by meaning.
        format!(
            r#"{{"time_ms":{},"tenant":"acme","outcome":"miss","similarity":0.62,"ttft_ms":300.0,"total_ms":1200.0,"question":"How do I reset my password?"}}"#,
            T + 1000
        ),
        format!(
            r#"{{"time_ms":{},"tenant":"acme","outcome":"exact","tier":"memory","ttft_ms":2.0,"total_ms":2.0,{}}}"#,
            T + 2000,
            saved(12, 30, 1500, 0.002)
        ),
        format!(
            r#"{{"time_ms":{},"tenant":"acme","outcome":"semantic","similarity":0.91,"entry_id":"0000000000000000000000000000abcd","ttft_ms":9.0,"total_ms":9.0,{},"question":"I forgot my password","matched":"How do I reset my password?"}}"#,
            T + 3000,
            saved(12, 30, 1500, 0.002)
        ),
        // Second hour: beta misses and hits from Redis; an anonymous error and a bypass.
        format!(
            r#"{{"time_ms":{},"tenant":"beta","outcome":"miss","ttft_ms":200.0,"total_ms":800.0,"question":"What is the refund policy?"}}"#,
            T + HOUR + 5000
        ),
        format!(
            r#"{{"time_ms":{},"tenant":"beta","outcome":"exact","tier":"redis","ttft_ms":3.0,"total_ms":3.0,{}}}"#,
            T + HOUR + 6000,
            saved(20, 40, 2000, 0.004)
        ),
        format!(
            r#"{{"time_ms":{},"outcome":"error","error":"backend","total_ms":5.0}}"#,
            T + HOUR + 7000
        ),
        format!(
            r#"{{"time_ms":{},"outcome":"bypass","gate":"negation","similarity":0.88,"ttft_ms":100.0,"total_ms":400.0,"question":"Is it not free?"}}"#,
            T + HOUR + 8000
        ),
        // A verdict and a broken line.
        format!(
            r#"{{"time_ms":{},"outcome":"feedback","verdict":"wrong","id":"chatcmpl-1"}}"#,
            T + HOUR + 9000
        ),
        "{not json".to_string(),
        // Third hour: acme misses the same question again, closer this time.
        format!(
            r#"{{"time_ms":{},"tenant":"acme","outcome":"miss","similarity":0.7,"ttft_ms":250.0,"total_ms":1000.0,"question":"How do I reset my password?"}}"#,
            T + 2 * HOUR + 1000
        ),
    ]
}

fn write_log(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("requests.jsonl");
    std::fs::write(&path, log_lines().join("\n") + "\n").unwrap();
    path
}

/// Runs `reprise report` with `args`; its stdout (it must succeed).
fn report(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_reprise"))
        .arg("report")
        .args(args)
        .output()
        .expect("reprise runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_report_sums_up_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(dir.path());
    let log = log.to_str().unwrap();
    let md = report(&["--log", log]);
    assert!(md.starts_with("# reprise report"), "{md}");
    // 8 requests (the verdict and the broken line are not), 3 hits: 37.5 %; by tier.
    assert!(
        md.contains("| 8 | 3 | 37.5 % | 1 | 1 | 1 | 0 | 3 | 1 | 1 |"),
        "{md}"
    );
    assert!(
        md.contains("10 lines: 8 requests counted, 1 verdict lines, 1 lines skipped"),
        "{md}"
    );
    // Savings: tokens, backend seconds, cost.
    assert!(md.contains("| 44 | 100 | 5.0 | 0.0080 |"), "{md}");
    // Latency against the default targets.
    assert!(md.contains("whole answer 3 s, first token 1 s"), "{md}");
    assert!(md.contains("| whole answer, misses | 4 |"), "{md}");
    // The most missed question with its best similarity; the pair served by meaning; the gate.
    assert!(
        md.contains("| How do I reset my password? | 2 | 2 | 0.700 |"),
        "{md}"
    );
    assert!(
        md.contains("| I forgot my password | How do I reset my password? | 0.910 | 1 | 1 |"),
        "{md}"
    );
    assert!(md.contains("| negation | 1 |"), "{md}");
    // Three hourly intervals.
    assert!(md.contains("| 2026-01-01T00:00:00Z | 3 | 66.7 % |"), "{md}");
    assert!(md.contains("| 2026-01-01T02:00:00Z | 1 | 0.0 % |"), "{md}");
}

/// Damage in the log costs what a line may: a run without line ends is skipped unread, a
/// time at the end of the clock does not overflow, and intervals beyond what a report shows
/// are refused, not held.
#[test]
fn a_damaged_log_is_read_within_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(dir.path());
    let mut text = std::fs::read_to_string(&log).unwrap();
    text.insert_str(0, &format!("{}\n", "x".repeat(3 << 20)));
    text.push_str(&"y".repeat(3 << 20));
    std::fs::write(&log, text).unwrap();
    let md = report(&["--log", log.to_str().unwrap()]);
    assert!(
        md.contains("12 lines: 8 requests counted, 1 verdict lines, 3 lines skipped"),
        "{md}"
    );

    let end = dir.path().join("end.jsonl");
    std::fs::write(
        &end,
        format!(
            "{{\"time_ms\":{},\"outcome\":\"miss\",\"total_ms\":1e300}}\n",
            u64::MAX - 1
        ),
    )
    .unwrap();
    report(&["--log", end.to_str().unwrap()]);

    let spread = dir.path().join("spread.jsonl");
    let lines: Vec<String> = (0..20_000u64)
        .map(|i| {
            format!(
                "{{\"time_ms\":{},\"outcome\":\"miss\",\"total_ms\":1.0}}",
                i * 1000
            )
        })
        .collect();
    std::fs::write(&spread, lines.join("\n")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_reprise"))
        .args([
            "report",
            "--log",
            spread.to_str().unwrap(),
            "--interval-secs",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("more than 10000 intervals"), "{stderr}");
}

#[test]
fn a_report_filters_by_time_and_tenant_and_reads_rotated_files() {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(dir.path());
    let log = log.to_str().unwrap();
    // The second hour, given as RFC 3339 and as epoch milliseconds.
    let until = (T + 2 * HOUR).to_string();
    let md = report(&[
        "--log",
        log,
        "--since",
        "2026-01-01T01:00:00Z",
        "--until",
        &until,
    ]);
    assert!(
        md.contains("| 4 | 1 | 25.0 % | 0 | 1 | 0 | 0 | 1 | 1 | 1 |"),
        "{md}"
    );
    assert!(md.contains("| 20 | 40 | 2.0 | 0.0040 |"), "{md}");
    // One tenant.
    let md = report(&["--log", log, "--tenant", "acme"]);
    assert!(
        md.contains("| 4 | 2 | 50.0 % | 1 | 0 | 1 | 0 | 2 | 0 | 0 |"),
        "{md}"
    );
    assert!(md.contains("Tenant: acme"), "{md}");
    let md = report(&["--log", log, "--tenant", "anonymous"]);
    assert!(md.contains("| 2 | 0 | 0.0 % |"), "{md}");
    // A rotated file is read with --rotated only.
    let older = format!(
        r#"{{"time_ms":{},"outcome":"exact","tier":"memory","total_ms":1.0}}"#,
        T - HOUR
    );
    std::fs::write(format!("{log}.1"), older + "\n").unwrap();
    assert!(report(&["--log", log]).contains("| 8 | 3 |"));
    let md = report(&["--log", log, "--rotated"]);
    assert!(md.contains("| 9 | 4 | 44.4 % |"), "{md}");
    assert!(md.contains("requests.jsonl.1"), "{md}");
}

#[test]
fn a_report_takes_targets_from_the_config_and_writes_an_html_page() {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(dir.path());
    let config = dir.path().join("reprise.toml");
    std::fs::write(
        &config,
        "[slo]\ntotal_secs = 0.5\nttft_secs = 0.25\n[metrics]\ncurrency = \"EUR\"\n",
    )
    .unwrap();
    let html = dir.path().join("report.html");
    let md = report(&[
        "--log",
        log.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
        "--interval-secs",
        "1800",
        "--html",
        html.to_str().unwrap(),
    ]);
    assert!(
        md.contains("whole answer 0.5 s, first token 0.25 s"),
        "{md}"
    );
    assert!(md.contains("0.0080 EUR"), "{md}");
    assert!(md.contains("intervals of 1800 s"), "{md}");
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.starts_with("<!doctype html>"));
    assert_eq!(
        page.matches("<svg").count(),
        3,
        "hit rate, latency, first token"
    );
    assert!(page.contains("Hit rate by tier"));
    assert!(page.contains("stroke-dasharray"), "the target line");
    assert!(page.contains("I forgot my password"));
    assert!(!page.contains("<script") && !page.contains("src="));
    // A bad time is refused with a message.
    let out = Command::new(env!("CARGO_BIN_EXE_reprise"))
        .args(["report", "--log", "x", "--since", "yesterday"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("RFC 3339"));
}
