//! Measures the false-hit gate against labelled prompt pairs with the real embedder.
//!
//! For each data set and each similarity threshold it prints, pair-wise, the share of true
//! pairs that would hit and the share of false pairs that would be served, with and without
//! the gate. Used to tune the gate and to choose the default threshold.
//!
//! ```text
//! cargo run --release -p reprise-policies --example gate_eval -- \
//!     [--models DIR] [--data DIR] [--cache FILE] [--show-rejected-true] [--show-served-false T]
//! ```
//!
//! Data: `DIR/fow-cache-pairs.jsonl` from the models folder (fields a, b, same_answer,
//! category), and `qqp_dev_4000.jsonl` ({text_a, text_b, label}), `hf_docs_pairs.json`
//! ([{origin, similar}], all paraphrases) and `traps_dev.jsonl` (a, b, same_answer,
//! category; nothing was tuned on it before the order and scope rules) from the paraphrase
//! data folder.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use reprise_embedder::{cosine, Embedder, EmbedderConfig, FastEmbedder};
use reprise_policies::gate;
use serde_json::Value;

/// One labelled pair.
struct Pair {
    a: String,
    b: String,
    same: bool,
    category: String,
}

struct Args {
    models: PathBuf,
    data: PathBuf,
    cache: Option<PathBuf>,
    show_rejected_true: bool,
    show_served_false: Option<f32>,
}

fn args() -> Args {
    let mut out = Args {
        models: std::env::var_os("REPRISE_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models"))),
        data: PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/data/paraphrase"
        )),
        cache: None,
        show_rejected_true: false,
        show_served_false: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--models" => out.models = it.next().expect("--models DIR").into(),
            "--data" => out.data = it.next().expect("--data DIR").into(),
            "--cache" => out.cache = Some(it.next().expect("--cache FILE").into()),
            "--show-rejected-true" => out.show_rejected_true = true,
            "--show-served-false" => {
                out.show_served_false = Some(
                    it.next()
                        .and_then(|t| t.parse().ok())
                        .expect("--show-served-false THRESHOLD"),
                )
            }
            other => panic!("unknown argument {other}"),
        }
    }
    out
}

fn read_lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn s(v: &Value, k: &str) -> String {
    v[k].as_str().unwrap_or_default().to_string()
}

fn datasets(a: &Args) -> Vec<(&'static str, Vec<Pair>)> {
    let fow = read_lines(&a.models.join("fow-cache-pairs.jsonl"))
        .iter()
        .map(|v| Pair {
            a: s(v, "a"),
            b: s(v, "b"),
            same: v["same_answer"].as_bool().unwrap_or(false),
            category: format!("{}/{}", s(v, "category"), s(v, "style")),
        })
        .collect();
    let qqp = read_lines(&a.data.join("qqp_dev_4000.jsonl"))
        .iter()
        .map(|v| Pair {
            a: s(v, "text_a"),
            b: s(v, "text_b"),
            same: v["label"].as_i64() == Some(1),
            category: "qqp".into(),
        })
        .collect();
    let hf_path = a.data.join("hf_docs_pairs.json");
    let hf: Value = serde_json::from_str(
        &std::fs::read_to_string(&hf_path).unwrap_or_else(|e| panic!("{}: {e}", hf_path.display())),
    )
    .expect("a JSON array");
    let hf = hf
        .as_array()
        .expect("a JSON array")
        .iter()
        .map(|v| Pair {
            a: s(v, "origin"),
            b: s(v, "similar"),
            same: true,
            category: "hf_docs".into(),
        })
        .collect();
    let traps = read_lines(&a.data.join("traps_dev.jsonl"))
        .iter()
        .map(|v| Pair {
            a: s(v, "a"),
            b: s(v, "b"),
            same: v["same_answer"].as_bool().unwrap_or(false),
            category: s(v, "category"),
        })
        .collect();
    vec![
        ("fow-cache", fow),
        ("qqp", qqp),
        ("hf_docs", hf),
        ("traps_dev", traps),
    ]
}

/// Cosine of every pair, from the cache file when it has them.
async fn similarities(
    e: &FastEmbedder,
    pairs: &[Pair],
    cache: &mut HashMap<(String, String), f32>,
) -> Vec<f32> {
    let missing: Vec<String> = pairs
        .iter()
        .filter(|p| !cache.contains_key(&(p.a.clone(), p.b.clone())))
        .flat_map(|p| [p.a.clone(), p.b.clone()])
        .collect();
    for chunk in missing.chunks(256) {
        let v = e.embed_many(chunk).await.expect("embedding");
        for (i, pair) in chunk.chunks(2).enumerate() {
            let sim = cosine(&v[2 * i], &v[2 * i + 1]);
            cache.insert((pair[0].clone(), pair[1].clone()), sim);
        }
    }
    pairs
        .iter()
        .map(|p| cache[&(p.a.clone(), p.b.clone())])
        .collect()
}

fn pct(n: usize, d: usize) -> f64 {
    if d == 0 {
        0.0
    } else {
        100.0 * n as f64 / d as f64
    }
}

#[tokio::main]
async fn main() {
    let args = args();
    let mut cache: HashMap<(String, String), f32> = HashMap::new();
    if let Some(path) = &args.cache {
        if let Ok(text) = std::fs::read_to_string(path) {
            for line in text.lines() {
                let mut parts = line.splitn(3, '\t');
                if let (Some(c), Some(a), Some(b)) = (parts.next(), parts.next(), parts.next()) {
                    let a = a.replace("\\t", "\t").replace("\\n", "\n");
                    let b = b.replace("\\t", "\t").replace("\\n", "\n");
                    cache.insert((a, b), c.parse().expect("a number"));
                }
            }
        }
    }
    let embedder = FastEmbedder::load(EmbedderConfig {
        model_dir: args.models.join("all-MiniLM-L6-v2"),
        onnx_runtime: args.models.join("libonnxruntime.so"),
        max_batch: 64,
        ..EmbedderConfig::default()
    })
    .expect("embedder");

    for (name, pairs) in datasets(&args) {
        let sims = similarities(&embedder, &pairs, &mut cache).await;
        let started = std::time::Instant::now();
        let verdicts: Vec<_> = pairs.iter().map(|p| gate(&p.a, &p.b)).collect();
        let per_pair_us = started.elapsed().as_secs_f64() * 1e6 / pairs.len() as f64;
        let n_true = pairs.iter().filter(|p| p.same).count();
        let n_false = pairs.len() - n_true;
        println!(
            "\n== {name}: {n_true} true pairs, {n_false} false pairs (gate {per_pair_us:.1} µs/pair)"
        );
        println!("threshold | true hit %  gated | false served %  gated");
        for step in 0..=14 {
            let t = 0.70 + 0.02 * step as f32;
            let (mut th, mut tg, mut fh, mut fg) = (0, 0, 0, 0);
            for ((p, sim), v) in pairs.iter().zip(&sims).zip(&verdicts) {
                if *sim < t {
                    continue;
                }
                match (p.same, v.is_pass()) {
                    (true, pass) => {
                        th += 1;
                        tg += pass as usize;
                    }
                    (false, pass) => {
                        fh += 1;
                        fg += pass as usize;
                    }
                }
            }
            println!(
                "   {t:.2}   |  {:5.1}  {:5.1}   |     {:5.1}     {:5.1}",
                pct(th, n_true),
                pct(tg, n_true),
                pct(fh, n_false),
                pct(fg, n_false)
            );
        }
        // Rejection reasons on true and false pairs, over all pairs.
        let mut reasons: HashMap<(bool, &str), usize> = HashMap::new();
        for (p, v) in pairs.iter().zip(&verdicts) {
            if let Some(r) = v.reason() {
                *reasons.entry((p.same, r)).or_default() += 1;
            }
        }
        let mut reasons: Vec<_> = reasons.into_iter().collect();
        reasons.sort();
        println!("gate rejections (true pair?, reason) → count: {reasons:?}");
        if matches!(name, "fow-cache" | "traps_dev") {
            let mut cats: Vec<&str> = pairs.iter().map(|p| p.category.as_str()).collect();
            cats.sort();
            cats.dedup();
            println!("per category at 0.80 / 0.86 / 0.90: hit-or-served % raw → gated");
            for c in cats {
                let in_cat: Vec<usize> = (0..pairs.len())
                    .filter(|&i| pairs[i].category == c)
                    .collect();
                let row: Vec<String> = [0.80f32, 0.86, 0.90]
                    .iter()
                    .map(|&t| {
                        let raw = in_cat.iter().filter(|&&i| sims[i] >= t).count();
                        let gated = in_cat
                            .iter()
                            .filter(|&&i| sims[i] >= t && verdicts[i].is_pass())
                            .count();
                        format!(
                            "{:5.1}→{:5.1}",
                            pct(raw, in_cat.len()),
                            pct(gated, in_cat.len())
                        )
                    })
                    .collect();
                println!("  {c:<22} n={:<4} {}", in_cat.len(), row.join("  "));
            }
        }
        for (i, p) in pairs.iter().enumerate() {
            let v = verdicts[i];
            if args.show_rejected_true && p.same && !v.is_pass() && sims[i] >= 0.8 {
                println!(
                    "  TRUE rejected [{}] {:.3} {} | {} ({})",
                    v.reason().unwrap_or(""),
                    sims[i],
                    p.a,
                    p.b,
                    p.category
                );
            }
            if let Some(t) = args.show_served_false {
                if !p.same && v.is_pass() && sims[i] >= t {
                    println!(
                        "  FALSE served {:.3} {} | {} ({})",
                        sims[i], p.a, p.b, p.category
                    );
                }
            }
        }
    }

    if let Some(path) = &args.cache {
        let esc = |s: &str| s.replace('\t', "\\t").replace('\n', "\\n");
        let text: String = cache
            .iter()
            .map(|((a, b), c)| format!("{c}\t{}\t{}\n", esc(a), esc(b)))
            .collect();
        std::fs::write(path, text).expect("write the cache file");
    }
}
