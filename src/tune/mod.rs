//! `reprise tune`: the operator's threshold tool. From labelled pairs (`--pairs`, measured
//! with the configured embedder and the false-hit gate) or from the request log and its
//! verdicts (`--log`), the curve of hit rate and wrong hits at thresholds 0.70 to 0.99, the
//! lowest threshold whose wrong share among served hits meets a target, and the TOML that
//! applies it (globally, or to one tenant's policy).
//!
//! - [`curve`]: the pure arithmetic (samples in, points out, the choice);
//! - [`pairs`]: the pair files (also read by `reprise-bench quality`) and their measurement;
//! - [`log`]: the request log, read leniently, verdicts joined by response id.

pub mod curve;
pub mod log;
pub mod pairs;

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::config::Config;
use curve::Point;

/// Options of `reprise tune`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["pairs", "log"])))]
pub struct TuneArgs {
    /// Labelled pairs (repeatable, all files make one curve): a JSON list of {origin,
    /// similar} (all the same answer), or JSON lines of {text_a, text_b, label} or {a, b,
    /// same_answer, category}. Side A is taken as stored, side B as asked.
    #[arg(long, value_name = "FILE", conflicts_with = "log")]
    pub pairs: Vec<PathBuf>,
    /// The request log (`[log] request_log`, JSON lines), its verdict lines
    /// (`"outcome": "feedback"`) included.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// With --log: read its rotated files too (`FILE.1`, `FILE.2`, ... up to the first
    /// missing one), oldest first.
    #[arg(long, requires = "log")]
    pub rotated: bool,
    /// With --log: more verdicts, JSON lines of {"id": "<response id>", "verdict": "wrong" |
    /// "right"}.
    #[arg(long, value_name = "FILE", requires = "log")]
    pub verdicts: Option<PathBuf>,
    /// With --pairs: the configuration whose `[semantic]` embedder (model_dir, onnx_runtime)
    /// and substitution check are used (`REPRISE__...` variables apply).
    #[arg(long, short, value_name = "FILE", requires = "pairs")]
    pub config: Option<PathBuf>,
    /// The largest share of wrong answers among served hits (with the gate) to choose the
    /// threshold for.
    #[arg(long, value_name = "SHARE", default_value_t = 0.02)]
    pub target_wrong: f64,
    /// Choose on the 95 % upper bound of the wrong share rather than its estimate: the
    /// lowest threshold whose judged answers show it within the target with that
    /// confidence (more judged answers needed; the learned thresholds of `delta` are as
    /// cautious).
    #[arg(long)]
    pub upper_bound: bool,
    /// Print the policy for this tenant (`[[tenants]]`); with --log, read only its requests
    /// (`anonymous` or `-`: the anonymous tenant's, whose policy is the global one). Without it, the global
    /// `[semantic] threshold` and, with --log, every tenant's requests.
    #[arg(long, value_name = "NAME")]
    pub tenant: Option<String>,
    /// With --pairs: at most this many pairs of each file (0: all).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub limit: usize,
    /// With --log: requests from this time on (RFC 3339, e.g. 2025-06-01T00:00:00Z, or ms
    /// since the Unix epoch).
    #[arg(long, value_name = "TIME", requires = "log", value_parser = log::parse_time)]
    pub since: Option<u64>,
    /// With --log: requests before this time (same forms).
    #[arg(long, value_name = "TIME", requires = "log", value_parser = log::parse_time)]
    pub until: Option<u64>,
}

/// Runs `reprise tune`: the table and the choice on stdout, progress on stderr; an error
/// (exit 1) when no threshold meets the target.
pub async fn run(args: TuneArgs) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&args.target_wrong) {
        anyhow::bail!("--target-wrong must be in [0, 1)");
    }
    // The anonymous tenant's policy is the global one.
    let anonymous = |t: &str| matches!(t, "-" | "anonymous");
    let tenant = args.tenant.as_deref().filter(|t| !anonymous(t));
    let (gated, evidence) = match &args.log {
        Some(path) => {
            let filter = log::Filter {
                tenant: args
                    .tenant
                    .as_deref()
                    .map(|t| if anonymous(t) { "" } else { t }.to_string()),
                since_ms: args.since,
                until_ms: args.until,
            };
            // Oldest first: the rotated files from the highest number, then the live one.
            let mut files = crate::stats::report::files(path, args.rotated);
            files.reverse();
            let data = log::read(&files, args.verdicts.as_deref(), &filter)?;
            print_log_summary(&data);
            let points = curve::log_curve(&data.samples);
            print!("{}", log_table(&points));
            (points, "judged hits")
        }
        None => {
            let samples = measure_pairs(&args).await?;
            let plain = curve::pairs_curve(&samples, false);
            let gated = curve::pairs_curve(&samples, true);
            print!("{}", pairs_table(&plain, &gated));
            (gated, "served pairs")
        }
    };
    let target = args.target_wrong;
    let chosen = match args.upper_bound {
        true => curve::choose_by_upper_bound(&gated, target),
        false => curve::choose(&gated, target),
    };
    let Some(chosen) = chosen else {
        anyhow::bail!(
            "no threshold from 0.70 to 0.99 keeps wrong answers at or under {:.1} % of the \
             {evidence} (with the gate{}): leave the threshold as it is, and gather more \
             {} before tuning",
            target * 100.0,
            if args.upper_bound {
                ", at a 95 % upper bound"
            } else {
                ""
            },
            if args.log.is_some() {
                "verdicts"
            } else {
                "pairs"
            }
        );
    };
    println!();
    println!("{}", choice(&chosen, target, evidence, args.upper_bound));
    let text = snippet(chosen.threshold, tenant);
    // What is printed must be what reprise reads: checked with the real parser.
    Config::from_toml(&text).context("the policy snippet does not parse")?;
    println!();
    print!("{text}");
    Ok(())
}

/// Loads the pairs and measures them with the configured embedder.
async fn measure_pairs(args: &TuneArgs) -> anyhow::Result<Vec<curve::PairSample>> {
    let mut config = Config::load(args.config.as_deref())?;
    // The embedder is needed whatever the configuration serves.
    config.semantic.enabled = true;
    let mut pairs = Vec::new();
    for path in &args.pairs {
        let mut p = pairs::load_pairs(path)?;
        if args.limit > 0 {
            p.truncate(args.limit);
        }
        let same = p.iter().filter(|p| p.same).count();
        println!(
            "{}: {} pairs ({same} the same answer, {} different)",
            path.display(),
            p.len(),
            p.len() - same
        );
        pairs.extend(p);
    }
    if pairs.is_empty() {
        anyhow::bail!("no pairs to measure");
    }
    let embedder = crate::state::build_embedder(&config)
        .await
        .with_context(|| {
            format!(
                "cannot load the embedder from {} (semantic.model_dir)",
                config.semantic.model_dir.display()
            )
        })?
        .context("the semantic tier is off")?;
    let substitution = config.semantic.substitution_threshold;
    eprintln!("embedding {} pairs", pairs.len());
    pairs::measure(embedder, substitution, &pairs, |done, total| {
        eprintln!("  {done}/{total} pairs");
    })
    .await
}

/// A share as `12.3 %`, or `none` without a denominator.
fn pct(share: Option<f64>, none: &str) -> String {
    share.map_or_else(|| none.to_string(), |s| format!("{:.1} %", 100.0 * s))
}

/// The pairs' curve, without and with the gate, one line per threshold.
pub fn pairs_table(plain: &[Point], gated: &[Point]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:>9}  {:>36}  {:>36}\n",
        "", "without the gate", "with the gate"
    ));
    out.push_str(&format!(
        "{:>9}  {:>10} {:>16} {:>8}  {:>10} {:>16} {:>8}\n",
        "threshold",
        "hit rate",
        "wrong of served",
        "served",
        "hit rate",
        "wrong of served",
        "served"
    ));
    for (p, g) in plain.iter().zip(gated) {
        out.push_str(&format!(
            "{:>9.2}  {:>10} {:>16} {:>8}  {:>10} {:>16} {:>8}\n",
            p.threshold,
            pct(p.hit_rate(), "-"),
            pct(p.wrong_share(), "-"),
            p.served,
            pct(g.hit_rate(), "-"),
            pct(g.wrong_share(), "-"),
            g.served
        ));
    }
    out.push_str(
        "hit rate: same-answer pairs served; wrong of served: served pairs labelled different\n",
    );
    out
}

/// The log's curve, one line per threshold.
pub fn log_table(points: &[Point]) -> String {
    let mut out = format!(
        "{:>9}  {:>10} {:>8} {:>8} {:>6} {:>16}\n",
        "threshold", "hit rate", "hits", "judged", "wrong", "wrong of judged"
    );
    for p in points {
        out.push_str(&format!(
            "{:>9.2}  {:>10} {:>8} {:>8} {:>6} {:>16}\n",
            p.threshold,
            pct(p.hit_rate(), "-"),
            p.hits,
            p.judged,
            p.wrong,
            pct(p.wrong_share(), "no verdicts")
        ));
    }
    out.push_str(
        "hit rate: requests whose best candidate reaches the threshold and passes the gate, of \
         all with a candidate;\nwrong of judged: wrong verdicts among the judged hits served at \
         or above it (none below the lowest similarity served)\n",
    );
    out
}

fn print_log_summary(d: &log::LogData) {
    println!(
        "{} lines read ({} unreadable, skipped); {} requests, {} with a semantic candidate, {} \
         served a semantic hit{}; {} verdicts, {} of them on those hits",
        d.lines,
        d.unreadable,
        d.requests,
        d.samples.len(),
        d.served,
        d.served_at.map_or(String::new(), |(lo, hi)| if lo == hi {
            format!(" (at threshold {lo:.2})")
        } else {
            format!(" (at thresholds {lo:.2} to {hi:.2})")
        }),
        d.verdicts,
        d.judged
    );
}

/// What the chosen threshold rests on.
pub fn choice(p: &Point, target: f64, evidence: &str, upper_bound: bool) -> String {
    let mut text = format!(
        "threshold {:.2}: the lowest whose wrong share (with the gate{}) is at most {:.1} %: {} \
         wrong of {} {evidence} ({}), hit rate {}.\nThe estimate rests on {} {evidence}; at \
         95 % confidence the wrong share may be up to {}.",
        p.threshold,
        if upper_bound {
            ", its 95 % upper bound"
        } else {
            ""
        },
        target * 100.0,
        p.wrong,
        p.judged,
        pct(p.wrong_share(), "-"),
        pct(p.hit_rate(), "-"),
        p.judged,
        pct(p.wrong_share_upper(), "-"),
    );
    if p.judged < 100 {
        text.push_str(" That is few: take it as a first estimate.");
    }
    text
}

/// The TOML that applies `threshold` with the gate: the global `[semantic]` policy, or a
/// selector-free rule first in the tenant's `semantic_rules`.
pub fn snippet(threshold: f32, tenant: Option<&str>) -> String {
    match tenant {
        None => format!(
            "# reprise.toml: in the [semantic] section\n[semantic]\nthreshold = {threshold:.2}\n\
             gate = true\n"
        ),
        Some(name) => format!(
            "# reprise.toml: in this tenant's entry (its keys and the rest of its policy stay);\n\
             # the first matching rule wins, so this one goes before its other semantic_rules\n\
             [[tenants]]\nname = {}\n\n[[tenants.policy.semantic_rules]]\n\
             threshold = {threshold:.2}\ngate = true\n",
            toml::Value::String(name.to_string())
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snippets_parse_with_the_real_config() {
        let c = Config::from_toml(&snippet(0.87, None)).unwrap();
        assert_eq!(c.semantic.threshold, 0.87);
        assert!(c.semantic.gate);
        let c = Config::from_toml(&snippet(0.91, Some("acme.eu"))).unwrap();
        assert_eq!(c.tenants[0].name, "acme.eu");
        let rule = &c.tenants[0].policy.semantic_rules[0];
        assert_eq!((rule.threshold, rule.gate), (Some(0.91), Some(true)));
        assert_eq!(
            (rule.namespace.as_deref(), rule.model.as_deref()),
            (None, None)
        );
        // A name the config refuses gives a snippet that does not parse.
        assert!(Config::from_toml(&snippet(0.9, Some("a b"))).is_err());
    }

    #[test]
    fn tables_have_a_line_per_threshold() {
        let s = |similarity, same| curve::PairSample {
            similarity,
            gate: true,
            same,
        };
        let samples = [s(0.95, true), s(0.85, false)];
        let t = pairs_table(
            &curve::pairs_curve(&samples, false),
            &curve::pairs_curve(&samples, true),
        );
        assert_eq!(t.lines().count(), 2 + 30 + 1);
        let line = t
            .lines()
            .find(|l| l.trim_start().starts_with("0.80"))
            .unwrap();
        assert!(
            line.contains("100.0 %") && line.contains("50.0 %"),
            "{line}"
        );
        let log = log_table(&curve::log_curve(&[curve::LogSample {
            similarity: 0.9,
            gate: true,
            served: true,
            threshold: Some(0.9),
            wrong: Some(false),
        }]));
        let line = log
            .lines()
            .find(|l| l.trim_start().starts_with("0.85"))
            .unwrap();
        assert!(line.ends_with("no verdicts"), "{line}");
        let line = log
            .lines()
            .find(|l| l.trim_start().starts_with("0.90"))
            .unwrap();
        assert!(line.ends_with("0.0 %"), "{line}");
    }
}
