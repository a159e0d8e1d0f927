//! ONNX Runtime's working memory for one model call, estimated from the model's shape, so the
//! batcher can keep every call within a byte budget.
//!
//! A transformer encoder holds, for a call of `n` texts padded to `L` tokens, activations that
//! grow with the tokens (`n × L × hidden`, several per layer) and attention scores that grow
//! with their square (`n × heads × L²`). ONNX Runtime's CPU arena keeps the largest call's
//! working memory for the life of the process, so the largest call sets the resident memory
//! the embedder adds. Measured on all-MiniLM-L6-v2 (int8, 384 hidden, 12 heads; RSS growth
//! over calls of 1–32 texts of 12–256 tokens, docs/BENCHMARKS.md): about 151 bytes per token
//! per hidden unit and 31 bytes per token pair per head. [`CallMemory`] rounds those up and
//! scales them by the configured model's own `hidden_size` and `num_attention_heads`.

use serde::Deserialize;

/// Bytes per token of a text, per unit of the model's hidden size.
const BYTES_PER_TOKEN_PER_HIDDEN: usize = 152;
/// Bytes per pair of tokens of a text, per attention head.
const BYTES_PER_PAIR_PER_HEAD: usize = 32;

/// The fields of a model's `config.json` the estimate reads, by their names in the common
/// transformer configurations (BERT's, DistilBERT's, GPT-2's). A file without them is an
/// error: an estimate from another model's shape would not bound anything.
#[derive(Debug, Deserialize)]
struct Shape {
    #[serde(alias = "dim", alias = "d_model", alias = "n_embd")]
    hidden_size: usize,
    #[serde(alias = "n_heads", alias = "num_heads", alias = "n_head")]
    num_attention_heads: usize,
}

/// The working memory of a model call, per text, as a function of the call's longest text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallMemory {
    per_token: usize,
    per_pair: usize,
}

impl CallMemory {
    /// The estimate for the model whose `config.json` is `config`.
    pub(crate) fn of(config: &[u8]) -> Result<CallMemory, String> {
        let shape: Shape =
            serde_json::from_slice(config).map_err(|e| format!("config.json: {e}"))?;
        Ok(CallMemory {
            per_token: shape.hidden_size.saturating_mul(BYTES_PER_TOKEN_PER_HIDDEN),
            per_pair: shape
                .num_attention_heads
                .saturating_mul(BYTES_PER_PAIR_PER_HEAD),
        })
    }

    /// Bytes one text padded to `tokens` takes in a call.
    pub(crate) fn per_text(&self, tokens: usize) -> usize {
        let pairs = tokens.saturating_mul(tokens);
        tokens
            .saturating_mul(self.per_token)
            .saturating_add(pairs.saturating_mul(self.per_pair))
    }

    /// Bytes a call of `texts` texts padded to `tokens` takes.
    pub(crate) fn call(&self, texts: usize, tokens: usize) -> usize {
        texts.saturating_mul(self.per_text(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::CallMemory;

    const MINILM: &[u8] =
        br#"{"model_type": "bert", "hidden_size": 384, "num_attention_heads": 12}"#;

    #[test]
    fn the_estimate_covers_what_was_measured() {
        let m = CallMemory::of(MINILM).unwrap();
        // RSS growth measured per text (MiB): 37.4 at 256 tokens, 12.9 at 128, 4.2 at 64.
        for (tokens, measured_mib) in [(256, 37.4), (128, 12.9), (64, 4.2), (12, 0.5)] {
            let estimate = m.per_text(tokens) as f64 / (1 << 20) as f64;
            assert!(
                estimate >= measured_mib && estimate < measured_mib * 1.6,
                "{tokens} tokens: {estimate:.1} MiB against {measured_mib} measured"
            );
        }
        // Quadratic in the length, linear in the texts.
        assert!(m.per_text(256) > 2 * m.per_text(128));
        assert_eq!(m.call(3, 100), 3 * m.per_text(100));
    }

    #[test]
    fn a_bigger_model_costs_more_and_a_bad_file_is_an_error() {
        let small = CallMemory::of(MINILM).unwrap();
        let big = CallMemory::of(br#"{"hidden_size": 768, "num_attention_heads": 12}"#).unwrap();
        assert!(big.per_text(128) > small.per_text(128));
        // DistilBERT names them otherwise.
        let distil = CallMemory::of(br#"{"dim": 768, "n_heads": 12}"#).unwrap();
        assert_eq!(distil, big);
        // Without them there is no estimate.
        assert!(CallMemory::of(b"{}").is_err());
        assert!(CallMemory::of(b"not json").is_err());
        // Saturates instead of overflowing.
        let huge = format!(
            r#"{{"hidden_size": {}, "num_attention_heads": 1}}"#,
            usize::MAX
        );
        let huge = CallMemory::of(huge.as_bytes()).unwrap();
        assert_eq!(huge.per_text(2), usize::MAX);
    }
}
