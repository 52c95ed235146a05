#!/usr/bin/env bash
# The demo: build, then train a tiny Qwen3-style MoE on a bundled corpus, export it
# to Hugging Face format and plot the loss.
set -euo pipefail
build="${1:-build}"
bin="$build/moetrain"
"$bin" --version
# The corpus: the King James Bible from Debian's bible-kjv, one JSON document per
# chapter in seven .jsonl(.zst) files, tokenized with the bundled data/tokenizer.json
# (a rerun finds the .bin files done and skips them).
root="$(cd "$(dirname "$0")/.." && pwd)"
demo="$build/demo"
if [ ! -d "$demo/kjv" ]; then
  rm -rf "$demo/kjv.tmp"
  python3 "$root/data/make_kjv_corpus.py" "$demo/kjv.tmp"
  mv "$demo/kjv.tmp" "$demo/kjv"
fi
"$bin" tokenize --tokenizer "$root/data/tokenizer.json" --input "$demo/kjv" --output "$demo/corpus" >/dev/null
# Train from scratch on the corpus (resuming if a previous demo run was interrupted),
# export the result as a Hugging Face folder, and plot the loss.
run="$demo/run"
"$bin" train --config "$root/configs/demo.toml" --data.corpus="$demo/corpus" --job.dump_folder="$run"
ckpt="$(dirname "$(ls "$run"/checkpoints/step-*/COMPLETE | sort | tail -n 1)")"
"$bin" export-hf --checkpoint "$ckpt" --output "$demo/hf" --dtype bf16
cp "$root/data/tokenizer.json" "$demo/hf/"
python3 "$root/scripts/plot_loss.py" "$run/metrics.jsonl" "$demo/loss.svg"
echo "demo: done. Hugging Face model: $demo/hf (with tokenizer.json); metrics: $run/metrics.jsonl"
