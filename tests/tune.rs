//! `reprise tune` run as an operator runs it: the binary on files, with the real MiniLM
//! embedder for pairs, its output read back (the printed TOML through the real parser).

use std::path::Path;
use std::process::{Command, Output};

use reprise::Config;

fn tune(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reprise"))
        .arg("tune")
        .args(args)
        .output()
        .expect("reprise runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A configuration whose `[semantic]` embedder is the fetched MiniLM.
fn config(dir: &Path) -> String {
    let models = reprise::harness::models_dir();
    let path = dir.join("reprise.toml");
    std::fs::write(
        &path,
        format!(
            "[semantic]\nmodel_dir = {:?}\nonnx_runtime = {:?}\n",
            models.join("all-MiniLM-L6-v2"),
            models.join("libonnxruntime.so")
        ),
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

/// The printed TOML (from its first comment line to the end), parsed by the real config.
fn snippet_config(out: &str) -> Config {
    let at = out.find("# reprise.toml").expect("a TOML snippet");
    Config::from_toml(&out[at..]).expect("the snippet parses")
}

/// The table's rows: `(threshold, rest of the line)`.
fn rows(out: &str) -> Vec<(f32, String)> {
    out.lines()
        .filter_map(|l| {
            let (t, rest) = l.trim_start().split_once(' ')?;
            Some((t.parse().ok()?, rest.to_string()))
        })
        .filter(|(t, _)| (0.0..1.0).contains(t))
        .collect()
}

#[test]
fn pairs_give_a_curve_and_a_threshold_the_config_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let same = [
        (
            "How do I reset my password?",
            "How can I reset my password?",
        ),
        (
            "What is the capital of France?",
            "What's the capital city of France?",
        ),
        (
            "How do I cancel my subscription?",
            "How can I cancel my subscription?",
        ),
        (
            "How do I change my email address?",
            "How can I change my email address?",
        ),
        (
            "What are your opening hours on Sunday?",
            "What are the opening hours on Sundays?",
        ),
    ];
    let different = [
        (
            "How do I reset my password?",
            "What will the weather be in Tokyo tomorrow?",
        ),
        (
            "What is the capital of France?",
            "How do I bake sourdough bread at home?",
        ),
        (
            "How do I cancel my subscription?",
            "Who won the football world cup in 2018?",
        ),
        (
            "Recommend a good science fiction novel",
            "How do I fix a flat bicycle tyre?",
        ),
    ];
    let lines: Vec<String> = same
        .iter()
        .map(|p| (p, true))
        .chain(different.iter().map(|p| (p, false)))
        .map(|((a, b), s)| serde_json::json!({"a": a, "b": b, "same_answer": s}).to_string())
        .collect();
    let pairs = dir.path().join("pairs.jsonl");
    std::fs::write(&pairs, lines.join("\n")).unwrap();
    let config = config(dir.path());
    let pairs = pairs.to_str().unwrap();

    let o = tune(&["--pairs", pairs, "--config", &config]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("9 pairs (5 the same answer, 4 different)"),
        "{out}"
    );
    assert!(out.contains("without the gate") && out.contains("with the gate"));
    let table = rows(&out);
    let thresholds: Vec<f32> = table.iter().map(|(t, _)| *t).collect();
    let expected: Vec<f32> = (70..=99).map(|i| i as f32 / 100.0).collect();
    assert_eq!(thresholds, expected, "{out}");
    // Obvious paraphrases and unrelated questions: at 0.70 nothing unrelated is served
    // (the columns: hit rate, wrong of served, served; without the gate, then with it).
    let cols: Vec<&str> = table[0].1.split_whitespace().collect();
    assert_eq!((cols[2], cols[7]), ("0.0", "0.0"), "{out}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("9/9 pairs"));
    let c = snippet_config(&out);
    assert!((0.70..=0.99).contains(&c.semantic.threshold), "{out}");
    assert!(out.contains(&format!(
        "threshold {:.2}: the lowest",
        c.semantic.threshold
    )));
    assert!(out.contains("The estimate rests on"), "{out}");

    // For a tenant: a rule in its policy.
    let o = tune(&["--pairs", pairs, "--config", &config, "--tenant", "acme"]);
    assert!(o.status.success());
    let c = snippet_config(&stdout(&o));
    assert_eq!(c.tenants[0].name, "acme");
    let threshold = c.tenants[0].policy.semantic_rules[0].threshold.unwrap();
    assert!((0.70..=0.99).contains(&threshold));

    // A pair labelled different whose sides are the same text is served at every
    // threshold: no threshold meets the target.
    let trap = dir.path().join("trap.jsonl");
    std::fs::write(
        &trap,
        "{\"text_a\": \"Is it open today?\", \"text_b\": \"Is it open today?\", \"label\": 0}\n",
    )
    .unwrap();
    let o = tune(&["--pairs", trap.to_str().unwrap(), "--config", &config]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no threshold from 0.70 to 0.99"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!stdout(&o).contains("# reprise.toml"));
}

#[test]
fn the_log_gives_a_curve_from_verdicts() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut lines = Vec::new();
    // Twenty hits served at 0.85, similarities 0.85 to 0.99; the two lowest judged wrong,
    // the rest right; ten misses below.
    for i in 0..20 {
        let sim = 0.85 + 0.007 * i as f32;
        lines.push(format!(
            "{{\"time_ms\":{},\"tenant\":\"acme\",\"outcome\":\"semantic\",\"id\":\"c-{i}\",\"similarity\":{sim},\"threshold\":0.85,\"gate\":\"pass\"}}",
            1_000 + i
        ));
        let verdict = if i < 2 { "wrong" } else { "right" };
        lines.push(format!(
            "{{\"time_ms\":{},\"tenant\":\"acme\",\"outcome\":\"feedback\",\"id\":\"c-{i}\",\"verdict\":\"{verdict}\"}}",
            5_000 + i
        ));
    }
    for i in 0..10 {
        lines.push(format!(
            "{{\"time_ms\":{},\"tenant\":\"acme\",\"outcome\":\"miss\",\"id\":\"m-{i}\",\"similarity\":0.{}}}",
            2_000 + i,
            60 + i
        ));
    }
    std::fs::write(&log, lines.join("\n")).unwrap();
    let o = tune(&[
        "--log",
        log.to_str().unwrap(),
        "--tenant",
        "acme",
        "--since",
        "1970-01-01T00:00:00Z",
        "--until",
        "4000",
    ]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("30 requests, 30 with a semantic candidate, 20 served"));
    let table = rows(&out);
    assert_eq!(table.len(), 30);
    // Below 0.85 nothing was served: no evidence.
    assert!(table[14].1.ends_with("no verdicts"), "{out}");
    // 0.85: 20 of 30 hit, 2 of 20 wrong; from 0.86 up (past both wrong ones) none.
    let cols: Vec<&str> = table[15].1.split_whitespace().collect();
    assert_eq!(cols, ["66.7", "%", "20", "20", "2", "10.0", "%"], "{out}");
    let c = snippet_config(&out);
    assert_eq!(c.tenants[0].policy.semantic_rules[0].threshold, Some(0.86));
    let upper_bound = |more: &[&str]| {
        let path = log.to_str().unwrap();
        let mut args = vec!["--log", path, "--tenant", "acme", "--until", "4000"];
        args.push("--upper-bound");
        args.extend(more);
        tune(&args)
    };
    // On the upper bound, 18 right answers without a wrong one do not show 2 %.
    let o = upper_bound(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(err.contains("95 % upper bound"), "{err}");
    // With a target the bound meets (18 judged, none wrong: about 18 %), it is chosen.
    let o = upper_bound(&["--target-wrong", "0.25"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("its 95 % upper bound"), "{out}");
    let c = snippet_config(&out);
    assert_eq!(c.tenants[0].policy.semantic_rules[0].threshold, Some(0.86));
}

#[test]
fn help_names_both_modes() {
    let o = tune(&["--help"]);
    let out = stdout(&o);
    for flag in [
        "--pairs",
        "--log",
        "--verdicts",
        "--target-wrong",
        "--upper-bound",
        "--tenant",
        "--since",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
    // One input is required, and only one.
    assert!(!tune(&[]).status.success());
    assert!(!tune(&["--pairs", "a", "--log", "b"]).status.success());
}
